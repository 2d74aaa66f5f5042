"""The trainer as a cluster job: one settings file (``cluster:`` + ``trainer:``) -> ``TrainingSettings``
-> a ``JobSpec``; and where the job's attempts leave their results (``results_path``, ``read_results``).

    name: grpo-nightly
    backend: slurm                    # or k8s / local; `posttrain train --backend` overrides it
    cluster:                          # SlurmConfig / KubernetesConfig / LocalConfig, see docs/cluster-backends.md
      shared_dir: /mnt/shared
      image: docker://ghcr.io#org/posttrain:1.0
      gpus_per_node: 8
    trainer:                          # TrainerConfig, names as in TRL's GRPOConfig
      model_name_or_path: /mnt/shared/models/qwen
      output_dir: /mnt/shared/runs/nightly
      dataset_manifest: /mnt/shared/datasets/<digest>/manifest.json
      reward_funcs: [posttrain.rewards:correctness_reward]
      max_steps: 500
      save_steps: 50

The job runs ``python -m posttrain.trainer {job_dir}/trainer.yaml`` (the trainer section written
into the job folder), not the ``TrainingJob`` callable, because a command:

- runs on every backend (Kubernetes runs commands only) and behind torchrun/accelerate, which
  start one process per GPU; a callable runs once per node inside submitit's process;
- resumes the same way after every kind of restart: the command is a ``CommandJob`` (a submitit
  Checkpointable), so Slurm's timeout/preemption signal (USR2) makes it SIGTERM the trainer,
  which saves at the end of its step and exits 75 before submitit requeues the job; a plain
  ``scontrol requeue``, a node failure or a Kubernetes pod restart kills it, and the next start
  resumes from the last *complete* checkpoint on shared storage (incomplete ones are discarded);
- keeps the trainer in its own process, so signals, CUDA state and imports never mix with
  submitit's, and the log shows exactly what the user would see running it by hand.

Each attempt appends its ``TrainingResult`` to ``<output_dir>/.posttrain/<name>-<run_id>.results.jsonl``
(``--result-file``), which is how the submitter learns where an attempt resumed from, and its
timeline beside it (``<name>-<run_id>.timeline.jsonl``: start, model loaded, steps, saves, end).
Pure pydantic: no torch, no submitit, nothing contacted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.cluster import checks
from posttrain.cluster.config import CONFIG_TYPES, KubernetesConfig, LocalConfig, SlurmConfig
from posttrain.cluster.errors import ConfigError
from posttrain.cluster.spec import NAME_MAX, JobName, JobSpec, RunId, new_run_id
from posttrain.fsutil import written_lines
from posttrain.trainer.config import TrainerConfig, TrainingResult
from posttrain.trainer.timeline import timeline_file_for

TRAINER_FILE = "trainer.yaml"
RESULTS_DIR = ".posttrain"
SECTIONS = ("name", "run_id", "backend", "cluster", "trainer", "python", "watch_dir")
DEFAULTED_TO_LOCAL = (
    "backend: not given (no --backend, no backend: in the file), so the local backend was used and cluster: "
    "was read as its settings; pass --backend slurm|k8s or add backend: to the file"
)


class SettingsError(ConfigError):
    """Invalid training settings: one line per problem, each starting with its dotted field name;
    ``field`` is the first of them."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        head = message.split(":", 1)[0]
        self.field = head if head and " " not in head else "settings"


class TrainingSettings(BaseModel):
    """The settings of one training run: where it runs (``cluster``) and what it trains (``trainer``)."""

    # an error about cluster.env must not echo a value that may be a credential
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    name: JobName = Field(default="train", description=f"Job name: a DNS-1123 label of at most {NAME_MAX} characters.")
    run_id: RunId | None = Field(
        default=None,
        description="Distinguishes submissions of the same job (job folder, results file); "
        "a UTC timestamp and 4 random hex digits when unset.",
    )
    cluster: Annotated[SlurmConfig | KubernetesConfig | LocalConfig, Field(discriminator="backend")] = Field(
        description="Backend settings; cluster.backend (slurm, k8s or local) selects which."
    )
    trainer: TrainerConfig = Field(description="Trainer settings, written to trainer.yaml in the job folder.")
    python: str | None = Field(
        default=None,
        description="Python that runs the trainer on the nodes; defaults to cluster.python on Slurm, "
        "python on Kubernetes and this interpreter locally.",
    )
    watch_dir: str | None = Field(
        default=None,
        description="Where this machine sees trainer.output_dir, to watch checkpoints (a mount of the "
        "shared file system or PVC). Defaults to output_dir itself locally and on Slurm without "
        "ssh_host; unset elsewhere, in which case only the job's state is followed.",
    )

    @field_validator("watch_dir")
    @classmethod
    def _watch_dir(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} is not an absolute path")
        return v

    @model_validator(mode="after")
    def _paths_on_shared_storage(self) -> TrainingSettings:
        cluster = self.cluster
        if isinstance(cluster, SlurmConfig):
            roots, where = cluster.shared_roots, "shared storage (under cluster.shared_dir or cluster.mounts)"
        elif isinstance(cluster, KubernetesConfig):
            roots, where = [cluster.pvc_mount], f"the PVC (under cluster.pvc_mount {cluster.pvc_mount})"
        else:
            return self
        t = self.trainer
        paths = {f: getattr(t, f) for f in ("output_dir", "dataset_manifest", "rollouts")}
        for field in ("model_name_or_path", "ref_model_name_or_path"):  # hub ids are fine
            value = getattr(t, field)
            paths[field] = value if value is not None and value.startswith("/") else None
        problems = [
            f"trainer.{field}: {value} is not on {where}; the nodes would not see it"
            for field, value in paths.items()
            if value is not None and not checks.is_under(str(value), roots)
        ]
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def backend(self) -> str:
        return self.cluster.backend

    @property
    def trainer_python(self) -> str:
        if self.python:
            return self.python
        if isinstance(self.cluster, SlurmConfig):
            return self.cluster.python
        return "python" if isinstance(self.cluster, KubernetesConfig) else sys.executable

    @classmethod
    def for_pipeline(cls, name: str, cluster: SlurmConfig | KubernetesConfig | LocalConfig,
                     trainer: TrainerConfig) -> TrainingSettings:
        """The settings of a pipeline's job. The pipeline shares the job's storage at the job's own
        paths: it stages the dataset and writes the rounds where the job reads them. On Kubernetes
        that means its machine mounts the PVC at ``pvc_mount`` (docs/site-setup.md), so it watches
        ``trainer.output_dir`` itself; elsewhere ``local_output_dir`` already says so."""
        watch = str(trainer.output_dir) if isinstance(cluster, KubernetesConfig) else None
        return cls(name=name, cluster=cluster, trainer=trainer, watch_dir=watch)

    @property
    def local_output_dir(self) -> Path | None:
        """Where this machine reads checkpoints and results, or None when it cannot."""
        if self.watch_dir is not None:
            return Path(self.watch_dir)
        cluster = self.cluster
        if isinstance(cluster, LocalConfig) or (isinstance(cluster, SlurmConfig) and cluster.ssh_host is None):
            return self.trainer.output_dir
        return None


def parse_training_settings(doc: dict[str, Any], backend: str | None = None, dry_run: bool = False) -> TrainingSettings:
    """Validate a settings mapping. ``backend`` overrides the mapping's ``backend:`` (default local);
    ``dry_run`` sets ``cluster.dry_run``. ``SettingsError`` lists every problem by dotted field name."""
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise SettingsError(f"{unknown[0]}: unknown setting; expected {', '.join(SECTIONS)}")
    data = {k: v for k, v in doc.items() if k != "backend"}
    given_backend = backend
    backend = backend or doc.get("backend") or "local"
    if backend not in CONFIG_TYPES:
        raise SettingsError(f"backend: {backend!r} is not one of {', '.join(CONFIG_TYPES)}")
    cluster = data.get("cluster") or {}
    if not isinstance(cluster, dict):
        raise SettingsError("cluster: expected a mapping of backend settings")
    data["cluster"] = {**cluster, "backend": backend, **({"dry_run": True} if dry_run else {})}
    try:
        return TrainingSettings.model_validate(data)
    except ValidationError as e:
        problems = describe_errors(e)
        about_cluster = any(i["loc"] and i["loc"][0] == "cluster" for i in e.errors())
        if about_cluster and not (given_backend or doc.get("backend")):
            problems += f"\n{DEFAULTED_TO_LOCAL}"  # last: the first line names the field at fault
        raise SettingsError(problems) from None


def load_training_settings(path: str | Path, backend: str | None = None, dry_run: bool = False) -> TrainingSettings:
    """Read and validate a settings YAML file (see the module docstring)."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise SettingsError(f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise SettingsError(f"{path}: expected a mapping with cluster: and trainer: sections")
    return parse_training_settings(doc, backend, dry_run)


def describe_errors(error: ValidationError) -> str:
    """One line per problem, each starting with its dotted field (``cluster.nodes``, ``trainer.max_steps``)."""
    lines = []
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ())]
        if len(loc) > 1 and loc[0] == "cluster" and loc[1] in CONFIG_TYPES:
            del loc[1]  # the union's tag, which the user never wrote
        message = item.get("msg", "").removeprefix("Value error, ")
        lines.append(f"{'.'.join(loc)}: {message}" if loc else message)
    return "\n".join(lines)


def trainer_yaml(trainer: TrainerConfig) -> str:
    """The trainer section as the job's ``trainer.yaml``: every setting, so the job folder records the run."""
    import yaml

    body = yaml.safe_dump(trainer.model_dump(mode="json", exclude_none=True), sort_keys=False)
    return "# written by posttrain train; read by python -m posttrain.trainer\n" + body


def results_path(output_dir: str | Path, name: str, run_id: str) -> str:
    """Where the attempts of run ``name``/``run_id`` append their TrainingResult (one JSON line each)."""
    return f"{str(output_dir).rstrip('/')}/{RESULTS_DIR}/{name}-{run_id}.results.jsonl"


def timeline_path(output_dir: str | Path, name: str, run_id: str) -> str:
    """Where rank 0 of each attempt of run ``name``/``run_id`` appends its timeline (``posttrain.trainer.timeline``)."""
    return timeline_file_for(results_path(output_dir, name, run_id))


class ResultsFileError(ValueError):
    """A finished line of a job's results file is not a ``TrainingResult`` (names the file and line)."""


def read_results(output_dir: str | Path, name: str, run_id: str) -> list[TrainingResult]:
    """The TrainingResult of every attempt of run ``name``/``run_id`` that ended on its own (completed
    or stopped to be requeued), oldest first, read from ``output_dir`` as this machine sees it; a
    killed attempt leaves none. Empty when the results file does not exist (yet). A last line still
    being written (no newline yet, or NULs as an NFS client may see them) is not read; a finished
    line that is not a result is a ``ResultsFileError``."""
    path = Path(results_path(output_dir, name, run_id))
    try:
        lines = written_lines(path)  # the job appends in place: a line being written is not read yet
    except FileNotFoundError:
        return []
    found = []
    for number, line in lines:
        if not line.strip():
            continue
        try:
            found.append(TrainingResult.model_validate_json(line))
        except ValidationError as e:
            raise ResultsFileError(f"{path}, line {number}: not a trainer result ({e.errors()[0]['msg']})") from None
    return found


def training_job_spec(config: TrainingSettings) -> JobSpec:
    """The ``JobSpec`` that runs the trainer: ``python -m posttrain.trainer {job_dir}/trainer.yaml``."""
    run_id = config.run_id or new_run_id()
    output_dir = str(config.trainer.output_dir)
    command = [
        config.trainer_python, "-m", "posttrain.trainer", f"{{job_dir}}/{TRAINER_FILE}",
        "--result-file", results_path(output_dir, config.name, run_id),
    ]  # fmt: skip
    return JobSpec(
        name=config.name,
        run_id=run_id,
        command=command,
        output_dir=output_dir,
        files={TRAINER_FILE: trainer_yaml(config.trainer)},
    )
