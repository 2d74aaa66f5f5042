"""Kubernetes objects of a job, as plain dicts in apply order: headless Service, ConfigMap, the
Secret of ``secrets:`` (when listed), Indexed Job. Pure functions: nothing here talks to a cluster.

The Secret is rendered with ``${NAME}`` placeholders, never values: submission fills them in from
the submitting environment (``k8s.py``), and the containers read it through ``envFrom``.

Pod ``i`` of the Indexed Job has the hostname ``<job>-i`` in the Service's subdomain, so rank 0
is ``<job>-0.<job>.<namespace>.svc.cluster.local``; ``JOB_COMPLETION_INDEX`` is the node rank.
The Service and ConfigMap carry owner references to the Job once submitted (see ``k8s.py``).
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from posttrain.cluster import checks, job_secrets, rendezvous
from posttrain.cluster.config import K8S_RESERVED_ENV, OBJECT_STORAGE_ENV, RESERVED_PREFIXES, KubernetesConfig
from posttrain.cluster.errors import ConfigError
from posttrain.cluster.launch import Topology, launch_line
from posttrain.cluster.spec import JobSpec

JOB_LABEL = "posttrain/job"
CONTAINER = "main"
JOB_MOUNT = "/posttrain-job"
SCRATCH = "/scratch"
TOKEN_DIR = "/var/run/caios"
ENTRYPOINT = "entrypoint.sh"


def job_name(config: KubernetesConfig, spec: JobSpec) -> str:
    name = config.job_name or f"{spec.name}-{spec.run_id}"
    try:
        return checks.dns_label(name, 52)
    except ValueError as e:
        raise ConfigError("job.name", f"{e}; shorten job.name or set cluster.job_name") from None


def master_addr(config: KubernetesConfig, name: str) -> str:
    return rendezvous.k8s_address(config, name)


def check(config: KubernetesConfig, spec: JobSpec) -> JobSpec:
    """The spec with ``{job_dir}`` resolved, checked against this cluster; ``ConfigError``."""
    if spec.function is not None:
        raise ConfigError("job.function", "the Kubernetes backend runs commands; set job.command instead")
    spec = spec.with_job_dir(JOB_MOUNT)
    if spec.output_dir is not None:
        try:
            out = checks.absolute_path(spec.output_dir)
        except ValueError as e:
            raise ConfigError("job.output_dir", str(e)) from None
        if not checks.is_under(out, [config.pvc_mount]):
            raise ConfigError(
                "job.output_dir", f"{out} is not on the PVC (under pvc_mount {config.pvc_mount}); it would be lost"
            )
    try:
        checks.env_names(spec.env, _reserved(config), RESERVED_PREFIXES)
        checks.no_plain_secrets(spec.env, "the cluster's secrets (or secret_env)")
    except ValueError as e:
        raise ConfigError("job.env", str(e)) from None
    clash = sorted(k for k in set(spec.env) & set(config.env) if spec.env[k] != config.env[k])
    clash += sorted(set(spec.env) & (set(config.secret_env) | set(config.secrets)))
    if clash:
        raise ConfigError(
            "job.env", f"{', '.join(clash)} also set in cluster.env, cluster.secret_env or cluster.secrets"
        )
    try:
        node_command(config, spec)
    except ValueError as e:
        raise ConfigError("job.command", str(e)) from None
    return spec


def _reserved(config: KubernetesConfig) -> set[str]:
    return set(K8S_RESERVED_ENV) | (set(OBJECT_STORAGE_ENV) if config.object_storage else set())


def node_command(config: KubernetesConfig, spec: JobSpec) -> str:
    assert spec.command is not None
    topo = Topology(config.nodes, config.gpus_per_node, node_rank="$JOB_COMPLETION_INDEX")
    return launch_line(config.launcher, config.launcher_args, spec.command, topo)


def entrypoint(config: KubernetesConfig, spec: JobSpec, name: str) -> str:
    lines = [
        "#!/bin/bash",
        f"# posttrain job {name} (run {spec.run_id}): runs once per pod; JOB_COMPLETION_INDEX is the node rank.",
        "set -euo pipefail",
    ]
    if config.nodes > 1:
        lines += [
            "# rank 0's name resolves once its pod has an address (the Service publishes not-ready pods)",
            "if command -v getent >/dev/null; then",
            '  for _ in $(seq 300); do getent hosts "$MASTER_ADDR" >/dev/null && break; sleep 2; done',
            "fi",
        ]
    lines += list(config.setup_commands)
    lines += [f"exec {node_command(config, spec)}", ""]
    return "\n".join(lines)


def _env(config: KubernetesConfig, spec: JobSpec, name: str) -> list[dict[str, Any]]:
    user = {**config.env, **spec.env}
    fixed = {
        "MASTER_ADDR": master_addr(config, name),
        "MASTER_PORT": str(config.master_port),
        "POSTTRAIN_JOB_DIR": JOB_MOUNT,
    }
    # Defaults: left out when the user sets the same name (the user's value is what runs).
    defaults = {
        "HF_HOME": f"{config.pvc_mount}/hf",
        "HF_HUB_CACHE": f"{config.pvc_mount}/hf/hub",
        "HF_DATASETS_CACHE": f"{config.pvc_mount}/hf/datasets",
        "TRITON_CACHE_DIR": f"{SCRATCH}/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH}/inductor",
    }
    if config.rdma:
        defaults |= {"NCCL_IB_HCA": "ibp", "NCCL_SOCKET_IFNAME": "eth0"}
    storage = config.object_storage
    if storage is not None:
        fixed |= {
            "AWS_CONTAINER_CREDENTIALS_FULL_URI": f"{storage.credentials_url.rstrip('/')}/{storage.org_id}",
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": f"{TOKEN_DIR}/token",
            "AWS_ENDPOINT_URL_S3": storage.endpoint,
            "AWS_REGION": storage.region,
        }
        defaults["AWS_REQUEST_CHECKSUM_CALCULATION"] = "when_required"
    env = [{"name": k, "value": v} for k, v in fixed.items()]
    env += [{"name": k, "value": v} for k, v in defaults.items() if k not in user and k not in config.secret_env]
    env += [{"name": k, "value": v} for k, v in sorted(user.items())]
    for k, ref in sorted(config.secret_env.items()):
        secret, key = ref.split("/", 1)
        env.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return env


def secret(config: KubernetesConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """The Secret of ``secrets:``, each value a ``${NAME}`` placeholder (filled in at submission)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {name: "${" + name + "}" for name in sorted(config.secrets)},
    }


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind)


def manifests(config: KubernetesConfig, spec: JobSpec) -> list[dict[str, Any]]:
    """Service, ConfigMap, Secret (with ``secrets:``) and Job for ``spec``, in apply order (no owner
    references yet)."""
    spec = check(config, spec)
    name = job_name(config, spec)
    labels = {"app.kubernetes.io/managed-by": "posttrain", JOB_LABEL: name}
    meta = {"name": name, "namespace": config.namespace, "labels": dict(labels)}

    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": dict(meta, labels=dict(labels)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: name},
            "ports": [{"name": "rdzv", "port": config.master_port, "targetPort": config.master_port}],
        },
    }
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": dict(meta, labels=dict(labels)),
        "data": {ENTRYPOINT: entrypoint(config, spec, name), **dict(sorted(spec.files.items()))},
    }

    resources: dict[str, str] = {"cpu": config.cpu, "memory": config.memory_request}
    if config.gpus_per_node:
        resources["nvidia.com/gpu"] = str(config.gpus_per_node)
    if config.rdma:
        resources["rdma/ib"] = "1"
    mounts = [
        {"name": "data", "mountPath": config.pvc_mount},
        {"name": "job", "mountPath": JOB_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "data", "persistentVolumeClaim": {"claimName": config.pvc}},
        {"name": "job", "configMap": {"name": name}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
        {"name": "scratch", "emptyDir": {"sizeLimit": config.scratch_size} if config.scratch_size else {}},
    ]
    if config.object_storage is not None:
        mounts.append({"name": "caios-token", "mountPath": TOKEN_DIR, "readOnly": True})
        token = {"path": "token", "audience": config.object_storage.audience, "expirationSeconds": 3600}
        volumes.append({"name": "caios-token", "projected": {"sources": [{"serviceAccountToken": token}]}})

    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": config.image,
        "command": ["/bin/bash", f"{JOB_MOUNT}/{ENTRYPOINT}"],
        "workingDir": spec.workdir or config.pvc_mount,
        "env": _env(config, spec, name),
        **({"envFrom": [{"secretRef": {"name": name}}]} if config.secrets else {}),
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": name,
        "containers": [container],
        "volumes": volumes,
    }
    if config.service_account:
        pod["serviceAccountName"] = config.service_account
    if config.priority_class:
        pod["priorityClassName"] = config.priority_class
    if config.node_selector:
        pod["nodeSelector"] = dict(config.node_selector)
    if config.tolerations:
        pod["tolerations"] = [
            {_camel(k): v for k, v in t.model_dump(exclude_none=True).items()} for t in config.tolerations
        ]
    if config.nodes > 1:
        term = {"labelSelector": {"matchLabels": {JOB_LABEL: name}}, "topologyKey": "kubernetes.io/hostname"}
        pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}

    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": config.nodes,
        "parallelism": config.nodes,
        "backoffLimit": config.backoff_limit,
    }
    if config.time_limit_s is not None:
        job_spec["activeDeadlineSeconds"] = config.time_limit_s
    if config.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = config.ttl_seconds_after_finished
    job_spec["template"] = {"metadata": {"labels": dict(labels)}, "spec": pod}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": dict(meta, labels=dict(labels)), "spec": job_spec}
    if config.secrets:
        return [service, configmap, secret(config, dict(meta, labels=dict(labels))), job]
    return [service, configmap, job]


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p.title() for p in rest)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=1 << 16, explicit_start=True)


def render(config: KubernetesConfig, spec: JobSpec) -> str:
    objects = manifests(config, spec)
    name = objects[-1]["metadata"]["name"]
    flags = (("--kubeconfig", config.kubeconfig), ("--context", config.context))
    kubectl = "kubectl" + "".join(f" {flag} {shlex.quote(v)}" for flag, v in flags if v)
    kinds = ", ".join(o["kind"] for o in objects)
    owned = "Service, ConfigMap and Secret" if config.secrets else "Service and ConfigMap"
    header = (
        f"# posttrain dry run: Kubernetes job {name} in namespace {config.namespace}; nothing was applied.\n"
        f"# Apply order: {kinds}. posttrain itself creates the Job first (suspended) and gives\n"
        f"# the {owned} owner references to it; applied by hand they have none, so clean up with:\n"
        f"#   {kubectl} -n {config.namespace} delete job,service,configmap{',secret' if config.secrets else ''} "
        f"-l {JOB_LABEL}={name}\n"
    )
    if config.nodes > 1:
        header += rendezvous.k8s_note(config, name)
    if config.secrets:
        names = " ".join("$" + n for n in sorted(config.secrets))
        header += (
            f"# secrets: {job_secrets.describe(config.secrets)}.\n"
            f"# The Secret holds ${{NAME}} placeholders; by hand: envsubst '{names}' < this-file | kubectl apply -f -\n"
        )
    return header + to_yaml(objects)
