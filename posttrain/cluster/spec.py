"""What a backend runs (``JobSpec``), and what it hands back (``JobHandle``).

A job is either a command (``["python", "-m", "posttrain.trainer", "{job_dir}/trainer.yaml"]``),
which the backend starts once per node through the configured launcher, or a picklable callable
that submitit runs once per node (Slurm, local). ``{job_dir}`` in the command, ``workdir``,
``output_dir`` and env values is replaced by the job's folder, where ``files`` are written.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.cluster import checks

JOB_DIR = "{job_dir}"
FILE_NAME = re.compile(r"^[-._a-zA-Z0-9]+$")
# Long enough for "<name>-<run_id>" to stay within the 52 characters of a Kubernetes Job name.
NAME_MAX = 31
RUN_ID_MAX = 20

JobName = Annotated[str, AfterValidator(lambda v: checks.dns_label(v, NAME_MAX))]
RunId = Annotated[str, AfterValidator(lambda v: checks.dns_label(v, RUN_ID_MAX))]


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


class JobSpec(BaseModel):
    """One job to run on a backend."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    name: JobName = Field(description=f"Job name: a DNS-1123 label of at most {NAME_MAX} characters.")
    run_id: RunId = Field(
        default_factory=new_run_id,
        description="Distinguishes runs of the same job (job folder, Kubernetes names); "
        "lowercase letters, digits and '-'. Defaults to a UTC timestamp and 4 random hex digits.",
    )
    command: list[str] | None = Field(
        default=None,
        description="Program and arguments started on every node. With the torchrun or accelerate "
        "launcher it must start with python (python, python3 or a path to one), unless launcher_args has "
        "--no-python (torchrun) or --no_python (accelerate).",
    )
    function: Callable[..., Any] | None = Field(
        default=None,
        exclude=True,
        description="Picklable callable run by submitit once per node instead of a command "
        "(Slurm and local backends); a submitit Checkpointable is requeued on timeout/preemption.",
    )
    args: tuple[Any, ...] = Field(default=(), exclude=True, description="Positional arguments of function.")
    kwargs: dict[str, Any] = Field(default_factory=dict, exclude=True, description="Keyword arguments of function.")
    env: dict[str, str] = Field(default_factory=dict, description="Variables of this job, added to the backend's env.")
    workdir: str | None = Field(default=None, description="Working directory of the job; defaults to the job folder.")
    output_dir: str | None = Field(
        default=None,
        description="Where the job writes checkpoints and results; must be on storage the nodes share.",
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="Small text files (run configs) written into the job folder, name -> content.",
    )

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        checks.env_names(v)
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not FILE_NAME.fullmatch(name) or name in {".", ".."}:
                raise ValueError(f"{name!r} is not a plain file name (letters, digits, '-', '_', '.')")
        return v

    @model_validator(mode="after")
    def _command_or_function(self) -> JobSpec:
        if (self.command is None) == (self.function is None):
            raise ValueError("set exactly one of command and function")
        if self.command is not None and not self.command:
            raise ValueError("command is empty")
        return self

    def with_job_dir(self, job_dir: str) -> JobSpec:
        """This spec with ``{job_dir}`` replaced in command, workdir, output_dir and env values."""

        def sub(s: str | None) -> str | None:
            return None if s is None else s.replace(JOB_DIR, job_dir)

        return self.model_copy(
            update={
                "command": None if self.command is None else [sub(a) for a in self.command],
                "workdir": sub(self.workdir),
                "output_dir": sub(self.output_dir),
                "env": {k: sub(v) for k, v in self.env.items()},
            }
        )


class JobState(str, Enum):
    """Backend-neutral job state; ``raw_state()`` on a handle gives the scheduler's own word."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    UNKNOWN = "UNKNOWN"
    DRY_RUN = "DRY_RUN"

    @property
    def terminal(self) -> bool:
        return self in {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT, JobState.DRY_RUN}


@runtime_checkable
class JobHandle(Protocol):
    """A submitted job. Used as a context manager it cancels the job when the block is left by
    an exception (KeyboardInterrupt included) while the job still runs.

    ``log_path`` is rank 0's log file (Slurm, local) or the kubectl command that follows every
    rank's log (Kubernetes). ``result()`` returns a callable job's return value (None for
    commands) and raises ``JobFailed`` with ``failure_reason()`` when the job did not complete."""

    job_id: str
    log_path: str

    def state(self) -> JobState: ...

    def done(self) -> bool: ...

    def tail_log(self, n: int = 40, rank: int | None = None) -> str: ...

    def cancel(self) -> None: ...

    def wait(self, timeout_s: float | None = None) -> JobState: ...

    def result(self, timeout_s: float | None = None) -> Any: ...

    def failure_reason(self) -> str | None: ...

    def __enter__(self) -> JobHandle: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Where jobs run: Slurm, Kubernetes or this machine."""

    def render(self, spec: JobSpec) -> str:
        """Everything that would be submitted, as text; contacts nothing."""
        ...

    def submit(self, spec: JobSpec) -> JobHandle:
        """Submit the job (or, with ``dry_run`` set, print ``render(spec)`` and submit nothing)."""
        ...
