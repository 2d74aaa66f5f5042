"""Settings of the three backends, with the names users know from Slurm/SUNK, Kubernetes/CKS
and submitit. Every error names its field; cross-field errors name the field to change."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain import redact
from posttrain.cluster import checks
from posttrain.cluster.launch import Launcher
from posttrain.polling import MIN_POLL_S

# Set by posttrain or by the launcher on every backend.
RESERVED_ENV = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
)
RESERVED_PREFIXES = ("POSTTRAIN_", "SUBMITIT_")
SLURM_RESERVED_PREFIXES = ("SLURM_", *RESERVED_PREFIXES)
K8S_RESERVED_ENV = RESERVED_ENV | {"JOB_COMPLETION_INDEX"}
# Set by the object_storage block; a user value would silently change where credentials come from.
OBJECT_STORAGE_ENV = frozenset(
    {
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
    }
)

PositiveInt = Annotated[int, Field(ge=1)]
_SSH_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]*$")
_SLURM_MEMORY = re.compile(r"^[0-9]+[KMGT]?$")
_SECRET_REF = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)/([-._a-zA-Z0-9]+)$")
_RDZV_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]+|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _env_and_secrets(config: _LaunchSettings) -> None:
    both = sorted(set(config.env) & set(config.secrets))
    if both:
        raise ValueError(f"env: {', '.join(both)} also listed in secrets")


def _launcher_topology(launcher: str, nodes: int) -> None:
    if launcher == "python" and nodes > 1:
        raise ValueError(
            "launcher python starts one process per node and sets up no rendezvous; "
            "use torchrun or accelerate for more than one node"
        )


def rdzv_host(value: str | None) -> str | None:
    """A host name or an IP address for MASTER_ADDR, or None."""
    if value is not None and not _RDZV_HOST.fullmatch(value):
        raise ValueError(f"{value!r} is not a host name or IP address")
    return value


def pyxis_image(value: str) -> str:
    """An image reference pyxis/enroot understands; registry hosts move before '#'."""
    if not value.strip():
        raise ValueError("image is empty")
    if re.search(r"[\s,]", value):
        raise ValueError(f"{value!r} contains whitespace or ','")
    if value.endswith(".sqsh"):
        if not value.startswith("/"):
            raise ValueError(f"{value!r}: a squashfs image must be an absolute path on shared storage")
        return checks.absolute_path(value)
    scheme, _, ref = value.rpartition("://")
    if scheme and scheme not in ("docker", "dockerd"):
        raise ValueError(f"{value!r}: pyxis takes docker:// references, .sqsh files or Docker Hub names")
    if "#" in ref:
        return value
    host, slash, path = ref.partition("/")
    has_registry = slash and ("." in host or ":" in host or host == "localhost")
    if has_registry and scheme:
        raise ValueError(f"{value!r}: enroot reads the registry before '#', write {scheme}://{host}#{path}")
    if has_registry:
        return f"docker://{host}#{path}"
    return value  # Docker Hub short name


class _LaunchSettings(BaseModel):
    # hide_input_in_errors: an error about env must not echo a value that may be a credential
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    launcher: Launcher = Field(
        default="torchrun",
        description="How a command job starts on each node: torchrun, accelerate (accelerate launch) or python "
        "(the command as is, single node).",
    )
    launcher_args: list[str] = Field(
        default_factory=list,
        description="Extra launcher flags (not topology: nodes and gpus_per_node set --nnodes, "
        "--nproc_per_node, --num_processes, ...).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Plain environment variables of the job (NCCL tuning, ...), written into its files and shown "
        "by dry runs; credentials are refused (by name, or a URL with a password): list them under secrets.",
    )
    secrets: list[str] = Field(
        default_factory=list,
        description="Names of environment variables whose values the job gets from the submitting environment "
        "at submit time, never written into a rendered file nor shown (Slurm: a 0600 file in the job folder "
        "sourced by node.sh; Kubernetes: a Secret owned by the Job, through envFrom; local: the job's "
        "environment). A name not set when submitting is an error.",
    )
    setup_commands: list[str] = Field(
        default_factory=list, description="Shell lines run on every node before the job starts."
    )
    time_limit: str | None = Field(
        default="24:00:00", description="Wall-clock limit: MM, HH:MM:SS or D-HH:MM:SS."
    )
    poll_interval_s: float = Field(default=10.0, ge=MIN_POLL_S, allow_inf_nan=False,
                                   description="Seconds between state checks of a job (at least 0.05).")
    dry_run: bool = Field(default=False, description="Show everything that would be submitted, submit nothing.")

    @field_validator("launcher_args")
    @classmethod
    def _launcher_args(cls, v: list[str]) -> list[str]:
        checks.launcher_args(v)
        return v

    @field_validator("time_limit")
    @classmethod
    def _time_limit(cls, v: str | None) -> str | None:
        if v is not None:
            checks.time_limit_seconds(v)
        return v

    @property
    def time_limit_s(self) -> int | None:
        return None if self.time_limit is None else checks.time_limit_seconds(self.time_limit)


class SlurmConfig(_LaunchSettings):
    """A Slurm cluster (CoreWeave SUNK or any Slurm with pyxis/enroot), through submitit."""

    backend: Literal["slurm"] = Field(default="slurm", description="Backend selector.")
    ssh_host: str | None = Field(
        default=None, description="Login-node alias for ssh when the submitter is not on the login node."
    )
    shared_dir: str = Field(
        description="Absolute path on the cluster's shared file system; job folders live under it."
    )
    job_root: str | None = Field(
        default=None,
        description="Folder of the job folders, on shared storage; defaults to <shared_dir>/posttrain-jobs.",
    )
    image: str | None = Field(
        default=None,
        description="Container for pyxis/enroot (docker://registry#repo:tag, a Docker Hub name, or an absolute "
        ".sqsh on shared storage); unset (null) runs on the nodes' own environment."
    )
    python: str = Field(
        default="python3",
        description="Python on the nodes (inside the image when set) that has posttrain and submitit installed.",
    )
    partition: str | None = Field(default=None, description="Slurm partition; the cluster default when unset.")
    account: str | None = Field(default=None, description="Slurm account.")
    qos: str | None = Field(default=None, description="Slurm quality of service.")
    nodes: PositiveInt = Field(default=1, description="Nodes; one task per node.")
    gpus_per_node: int = Field(default=8, ge=0, description="GPUs per node; processes per node for the launcher.")
    cpus_per_task: PositiveInt | None = Field(default=None, description="CPUs of the one task on each node.")
    memory: str = Field(default="0", description="Memory per node for sbatch --mem (0 = all of it), e.g. 500G.")
    exclusive: bool = Field(default=True, description="Whole nodes (sbatch --exclusive).")
    mounts: list[str] = Field(
        default_factory=list, description="Extra absolute shared paths bound into the container at the same path."
    )
    env_file: str | None = Field(
        default=None,
        description="Absolute path of a KEY=value file on shared storage, sourced inside the container "
        "(secrets such as HF_TOKEN); env wins over it.",
    )
    master_port: int = Field(default=29500, ge=1024, le=65535, description="Rendezvous port on the first node.")
    rdzv_host: str | None = Field(
        default=None,
        description="Rendezvous address (MASTER_ADDR) every node connects to. Unset: the NodeAddr of the "
        "allocation's first node, from `scontrol show node` (the address Slurm itself reaches it by), falling "
        "back to its name; set it when the nodes reach each other by another address (a fabric interface).",
    )
    max_requeues: int = Field(
        default=3, ge=0, description="Requeues after timeout or preemption (submitit max_num_timeout)."
    )
    signal_delay_s: int = Field(
        default=120, ge=10, description="Seconds before the time limit at which the job is told to checkpoint."
    )

    @field_validator("rdzv_host")
    @classmethod
    def _rdzv_host(cls, v: str | None) -> str | None:
        return rdzv_host(v)

    @field_validator("ssh_host")
    @classmethod
    def _ssh_host(cls, v: str | None) -> str | None:
        if v is not None and not _SSH_HOST.fullmatch(v):
            raise ValueError(f"{v!r} is not an ssh host alias")
        return v

    @field_validator("shared_dir", "job_root", "env_file")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        return None if v is None else checks.absolute_path(v)

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        return [checks.absolute_path(p) for p in v]

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return None if v is None else pyxis_image(v)

    @field_validator("partition", "account", "qos")
    @classmethod
    def _slurm_value(cls, v: str | None) -> str | None:
        if v is not None and not checks.SLURM_VALUE.fullmatch(v):
            raise ValueError(f"{v!r} has characters Slurm does not take here")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str) -> str:
        if not _SLURM_MEMORY.fullmatch(v):
            raise ValueError(f"{v!r} is not a Slurm memory size (0, 512000, 500G, ...)")
        return v

    @field_validator("time_limit")
    @classmethod
    def _required_time_limit(cls, v: str | None) -> str | None:
        if v is None:
            raise ValueError("Slurm jobs need a time limit")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        checks.env_names(v, RESERVED_ENV, SLURM_RESERVED_PREFIXES)
        checks.no_plain_secrets(v, "secrets (or put it in env_file)")
        return v

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: list[str]) -> list[str]:
        checks.secret_names(v, RESERVED_ENV, SLURM_RESERVED_PREFIXES)
        return v

    @model_validator(mode="after")
    def _shared(self) -> SlurmConfig:
        _env_and_secrets(self)
        shared = self.shared_roots
        for field in ("job_root", "env_file"):
            value = getattr(self, field)
            if value is not None and not checks.is_under(value, shared):
                raise ValueError(f"{field}: {value} is not on shared storage (under shared_dir or mounts)")
        if self.image and self.image.startswith("/") and not checks.is_under(self.image, shared):
            raise ValueError(f"image: {self.image} is not on shared storage (under shared_dir or mounts)")
        try:
            _launcher_topology(self.launcher, self.nodes)
        except ValueError as e:
            raise ValueError(f"launcher: {e}") from None
        return self

    @property
    def shared_roots(self) -> list[str]:
        return [self.shared_dir, *self.mounts]

    @property
    def jobs_dir(self) -> str:
        return self.job_root or f"{self.shared_dir.rstrip('/')}/posttrain-jobs"


class Toleration(BaseModel):
    """A Kubernetes toleration (names as in the pod spec)."""

    model_config = ConfigDict(extra="forbid")

    key: str | None = Field(default=None, description="Taint key; empty with operator Exists matches all taints.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; all effects when unset."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )


class ObjectStorage(BaseModel):
    """CoreWeave AI Object Storage through workload identity: no stored keys."""

    # hide_input_in_errors: an error about a URL must not echo it (it may hold a credential)
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    org_id: str = Field(description="CoreWeave organization id (for the temporary-credentials endpoint).")
    region: str = Field(description="Object storage region, exported as AWS_REGION.")
    endpoint: str = Field(
        default="http://cwlota.com", description="S3 endpoint inside the cluster (LOTA, the node-local cache)."
    )
    audience: str = Field(
        default="https://coreweave.com/iam", description="Audience of the projected service-account token."
    )
    credentials_url: str = Field(
        default="https://api.coreweave.com/v1/cwobject/temporary-credentials/oidc",
        description="Temporary-credentials endpoint; the org id is appended.",
    )

    @field_validator("endpoint", "audience", "credentials_url")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        return redact.no_credentials(v, "the pods get their credentials through workload identity")

    @field_validator("org_id", "region")
    @classmethod
    def _plain(cls, v: str) -> str:
        if not re.fullmatch(r"^[A-Za-z0-9][-A-Za-z0-9_.]*$", v):
            raise ValueError(f"{v!r} has characters not allowed here")
        return v


class KubernetesConfig(_LaunchSettings):
    """A Kubernetes cluster (CoreWeave CKS): headless Service + ConfigMap + Indexed Job."""

    backend: Literal["k8s"] = Field(default="k8s", description="Backend selector.")
    kubeconfig: str | None = Field(
        default=None, description="Kubeconfig file (~ expanded); in-cluster or ~/.kube/config when unset."
    )
    context: str | None = Field(default=None, description="Kubeconfig context; the current one when unset.")
    namespace: str = Field(description="Namespace of the job's objects.")
    job_name: str | None = Field(
        default=None, description="Name of the Job, Service and ConfigMap (DNS label, at most 52 characters); "
        "defaults to <job name>-<run id>."
    )
    image: str = Field(description="Container image of every pod.")
    nodes: PositiveInt = Field(default=1, description="Pods, one per node.")
    gpus_per_node: int = Field(default=8, ge=0, description="nvidia.com/gpu per pod; processes per pod.")
    cpu: str = Field(default="32", description="CPU request and limit per pod.")
    memory_request: str = Field(
        default="256Gi",
        description="Memory request and limit per pod; must hold a whole checkpoint on rank 0 when loading on CPU.",
    )
    shm_size: str = Field(default="64Gi", description="Size of /dev/shm (memory-backed; counts against memory).")
    pvc: str = Field(description="ReadWriteMany PersistentVolumeClaim (e.g. storage class shared-vast).")
    pvc_mount: str = Field(
        default="/data",
        description="Where the PVC is mounted; outputs and HF cache live here. A posttrain flow's machine mounts "
        "it at the same path (it writes the run folder the pods read and watches their checkpoints).",
    )
    scratch_size: str | None = Field(
        default=None, description="Size limit of node-local /scratch (Triton/inductor caches); unlimited when unset."
    )
    rdma: bool = Field(default=True, description="Request rdma/ib and set the InfiniBand NCCL variables.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations.")
    priority_class: str | None = Field(default=None, description="Pod priorityClassName.")
    service_account: str | None = Field(
        default=None, description="Pod serviceAccountName (its token is the object-storage identity)."
    )
    secret_env: dict[str, str] = Field(
        default_factory=dict, description="Variables from Secrets: ENV -> secret-name/key."
    )
    object_storage: ObjectStorage | None = Field(
        default=None, description="Object storage through workload identity (org_id, region)."
    )
    master_port: int = Field(default=29500, ge=1024, le=65535, description="Rendezvous port on pod 0.")
    rdzv_host: str | None = Field(
        default=None,
        description="Rendezvous address (MASTER_ADDR) every pod connects to. Unset: pod 0's stable name "
        "through the headless Service, <job>-0.<job>.<namespace>.svc.cluster.local.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=86400, ge=0, description="Delete the Job (and, through owner references, its Service and "
        "ConfigMap) this long after it ends; null keeps it."
    )
    stuck_timeout_s: float = Field(
        default=600, gt=0, description="Give up waiting when a pod stays this long in ImagePullBackOff, "
        "CreateContainerConfigError (missing Secret) or a similar state."
    )
    backoff_limit: int = Field(
        default=3, ge=0, description="Pod failures tolerated before the Job fails; a new pod resumes from checkpoints."
    )

    @model_validator(mode="before")
    @classmethod
    def _slurm_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and "env_file" in data:
            raise ValueError("env_file: a Slurm setting; on Kubernetes pass secrets through secret_env")
        return data

    @field_validator("rdzv_host")
    @classmethod
    def _rdzv_host(cls, v: str | None) -> str | None:
        return rdzv_host(v)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return checks.dns_label(v, 63)

    @field_validator("job_name")
    @classmethod
    def _job_name(cls, v: str | None) -> str | None:
        return None if v is None else checks.dns_label(v, 52)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v.strip() or re.search(r"\s", v):
            raise ValueError(f"{v!r} is not an image reference")
        return v

    @field_validator("cpu", "memory_request", "shm_size", "scratch_size")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        return None if v is None else checks.k8s_quantity(v)

    @field_validator("pvc", "priority_class", "service_account")
    @classmethod
    def _object_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", v):
            raise ValueError(f"{v!r} is not a Kubernetes object name")
        return v

    @field_validator("pvc_mount")
    @classmethod
    def _pvc_mount(cls, v: str) -> str:
        return checks.absolute_path(v)

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _LABEL_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a label key")
        return v

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, v: dict[str, str]) -> dict[str, str]:
        checks.env_names(v, K8S_RESERVED_ENV, RESERVED_PREFIXES)
        for name, ref in v.items():
            if not _SECRET_REF.fullmatch(ref):
                raise ValueError(f"{name}: {ref!r} is not secret-name/key")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        checks.env_names(v, K8S_RESERVED_ENV, RESERVED_PREFIXES)
        checks.no_plain_secrets(v, "secrets (or secret_env, from a Secret of the namespace)")
        return v

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: list[str]) -> list[str]:
        checks.secret_names(v, K8S_RESERVED_ENV, RESERVED_PREFIXES)
        return v

    @model_validator(mode="after")
    def _cross(self) -> KubernetesConfig:
        _env_and_secrets(self)
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"env: {', '.join(both)} also set in secret_env")
        both = sorted(set(self.secrets) & set(self.secret_env))
        if both:
            raise ValueError(f"secrets: {', '.join(both)} also set in secret_env")
        if self.object_storage is not None:
            for field in ("env", "secret_env", "secrets"):
                clash = sorted(set(getattr(self, field)) & OBJECT_STORAGE_ENV)
                if clash:
                    raise ValueError(f"{field}: {', '.join(clash)} is set by object_storage")
        try:
            _launcher_topology(self.launcher, self.nodes)
        except ValueError as e:
            raise ValueError(f"launcher: {e}") from None
        return self


class LocalConfig(_LaunchSettings):
    """This machine, through submitit's LocalExecutor (the embedded default)."""

    backend: Literal["local"] = Field(default="local", description="Backend selector.")
    launcher: Launcher = Field(
        default="python", description="How a command job starts: python, torchrun or accelerate."
    )
    folder: str = Field(default="~/.cache/posttrain/jobs", description="Folder of the job folders (~ expanded).")
    gpus: int = Field(default=0, ge=0, description="GPUs given to the job (CUDA_VISIBLE_DEVICES); torchrun "
                      "starts one process per GPU.")
    max_requeues: int = Field(default=3, ge=0, description="Restarts after timeout (submitit max_num_timeout).")
    signal_delay_s: int = Field(default=30, ge=1, description="Seconds before the time limit at which the job is "
                                "told to checkpoint.")
    poll_interval_s: float = Field(default=1.0, ge=MIN_POLL_S, allow_inf_nan=False,
                                   description="Seconds between state checks of a job (at least 0.05).")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        checks.env_names(v, RESERVED_ENV, RESERVED_PREFIXES)
        checks.no_plain_secrets(v, "secrets")
        return v

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: list[str]) -> list[str]:
        checks.secret_names(v, RESERVED_ENV, RESERVED_PREFIXES)
        return v

    @model_validator(mode="after")
    def _cross(self) -> LocalConfig:
        _env_and_secrets(self)
        return self


ClusterConfig = SlurmConfig | KubernetesConfig | LocalConfig
CONFIG_TYPES: dict[str, type[BaseModel]] = {"slurm": SlurmConfig, "k8s": KubernetesConfig, "local": LocalConfig}


def parse_cluster_config(backend: str, data: dict[str, Any]) -> ClusterConfig:
    """Validate the ``cluster:`` section for ``backend`` (slurm, k8s or local)."""
    try:
        cls = CONFIG_TYPES[backend]
    except KeyError:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(CONFIG_TYPES)}") from None
    data = dict(data)
    data.setdefault("backend", backend)
    return cls.model_validate(data)  # type: ignore[return-value]
