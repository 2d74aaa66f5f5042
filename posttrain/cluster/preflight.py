"""Checks before a job is queued: what the job will read exists, and its launcher is on the nodes'
PATH. Either failing inside the job costs a queue slot and minutes on a real cluster (a base model
path that does not exist reaches the job as an ``OSError`` about repo ids; a missing ``torchrun`` is
status 127).

Paths are checked where the submitter runs: on Slurm that is the login node (or ``ssh_host``),
which sees the cluster's shared storage; locally it is where the job runs; on Kubernetes it is the
machine running the flow, which mounts the job's PersistentVolumeClaim at ``pvc_mount`` as the
pods do (it writes the run folder the pods read: docs/site-setup.md), so a path must also be
under ``pvc_mount``, where it points too (a link on the PVC to a path off it is not seen by the
pods). On Slurm a path the job reads or writes must likewise be under the cluster's ``shared_dir``
or one of its ``mounts``, resolved too: the job's container binds only those, and the job's
settings refuse any other path, which without this check failed the run at submit, after staging.
A model folder (the base model, the reference model) must hold a ``config.json``. The
launcher of a Kubernetes job lives in the image: left to the job.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Collection, Mapping
from typing import Literal

from posttrain import redact
from posttrain.cluster import checks
from posttrain.cluster.command_job import JOB_SHELL
from posttrain.cluster.config import ClusterConfig, KubernetesConfig, LocalConfig, SlurmConfig
from posttrain.cluster.errors import ConfigError

PathKind = Literal["folder", "model folder", "file", "folder to create"]
LAUNCHER_PROGRAMS = {"torchrun": "torchrun", "accelerate": "accelerate"}
MISSING = "POSTTRAIN-LAUNCHER-MISSING"
# The probe is a one-task job: it waits at most this long for an allocation (srun --immediate), and
# the whole command at most PROBE_TIMEOUT_S; past either, the launcher is not checked (a warning).
PROBE_WAIT_S = 60
PROBE_TIMEOUT_S = 120
# Outcomes of the Slurm probe per cluster settings, for this process: one probe per cluster, not
# one per GRPO round. Only definite answers are kept (a probe that got no allocation is retried).
_probed: dict[str, str | None] = {}
# What a Hugging Face model folder holds whatever its weights' format (from_pretrained reads it first).
MODEL_CONFIG = "config.json"
# Seconds a check of a service's address waits for the connection (a scheduler that answers does at once).
CONNECT_TIMEOUT_S = 5.0


def _where(config: ClusterConfig) -> str:
    if isinstance(config, SlurmConfig):
        host = f"on {config.ssh_host}" if config.ssh_host else "on this login node"
        return f"checked {host}, which sees the cluster's shared storage"
    if isinstance(config, KubernetesConfig):
        return f"checked on this machine, which mounts the PVC {config.pvc} at {config.pvc_mount} as the pods do"
    return "checked on this machine, where the job runs"


def check_paths(config: ClusterConfig, paths: Mapping[str, tuple[str, PathKind]],
                job_reads: Collection[str] | None = None, block: str | None = None) -> None:
    """``ConfigError`` naming the first of ``paths`` (name -> (path, kind)) that is not there.
    A "folder to create" may be missing if its parent folder exists (the run creates it). A path
    the job reads or writes (``job_reads``, names of ``paths``; default all) off the job's storage
    is refused too: on Kubernetes outside ``pvc_mount``, on Slurm outside ``shared_dir`` and
    ``mounts`` (the message names them, and ``block``, the cluster block they are fields of)."""
    for name, (path, kind) in paths.items():
        read_by_job = job_reads is None or name in job_reads
        if isinstance(config, KubernetesConfig) and read_by_job:
            _check_on_pvc(config, name, path)
        if isinstance(config, SlurmConfig) and read_by_job:
            _check_on_shared_storage(config, name, path, block)
        problem = _path_problem(config, path, kind)
        if problem:
            raise ConfigError(name, f"{path} {problem} ({_where(config)})")


def _check_on_pvc(config: KubernetesConfig, name: str, path: str) -> None:
    """The path is under pvc_mount, and so is what it resolves to: a link on the PVC to a path off it
    resolves in the pods too, to a path their PVC does not hold."""
    if not checks.is_under(path, [config.pvc_mount]):
        raise ConfigError(name, f"{path} is not on the PVC (under pvc_mount {config.pvc_mount}); "
                                "the pods would not see it")
    real, mount = os.path.realpath(path), os.path.realpath(config.pvc_mount)
    if not checks.is_under(real, [mount]):
        raise ConfigError(name, f"{path} resolves to {real}, which is not on the PVC (under pvc_mount "
                                f"{config.pvc_mount}): a link points off it; the pods would not see it")


def _check_on_shared_storage(config: SlurmConfig, name: str, path: str, block: str | None) -> None:
    """The path is under shared_dir or a mount, and so is what it resolves to (on the login node,
    through ssh_host when set): the job's settings refuse any other path at submit, and a container
    binds only those."""
    mounts = f"mounts [{', '.join(config.mounts)}]" if config.mounts else "mounts (none)"
    of = f"of block {block}" if block else "of the cluster settings"
    fields = f"shared_dir {config.shared_dir} nor {mounts} {of}"
    fix = "move it there, or add its folder to mounts"
    if not checks.is_under(path, config.shared_roots):
        raise ConfigError(name, f"{path} is not on the cluster's shared storage (under neither {fields}); "
                                f"the nodes would not see it: {fix}")
    real, *roots = _resolved(config, [path, *config.shared_roots])
    if not checks.is_under(real, roots):
        raise ConfigError(name, f"{path} resolves to {real}, which is not on the cluster's shared storage (under "
                                f"neither {fields}): a link points off it; the nodes would not see it: {fix}")


def _resolved(config: SlurmConfig, paths: list[str]) -> list[str]:
    """The paths with their links resolved where the submitter runs (a missing tail kept as is).
    Through ssh_host: GNU ``realpath -m``; a login node without it leaves the paths as written."""
    if not config.ssh_host:
        return [os.path.realpath(p) for p in paths]
    from posttrain.cluster.shell import SshShell

    result = SshShell(config.ssh_host).run(["realpath", "-m", "--", *paths], check=False, timeout=60)
    lines = result.stdout.decode(errors="replace").splitlines()
    return lines if result.returncode == 0 and len(lines) == len(paths) else paths


def _path_problem(config: ClusterConfig, path: str, kind: PathKind) -> str | None:
    if isinstance(config, SlurmConfig) and config.ssh_host:
        return _remote_path_problem(config, path, kind)
    if kind == "file":
        return None if os.path.isfile(path) else ("is not a file" if os.path.exists(path) else "does not exist")
    if kind == "model folder" and os.path.isdir(path) and not os.path.isfile(os.path.join(path, MODEL_CONFIG)):
        return f"has no {MODEL_CONFIG}: not a Hugging Face model folder"
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return "is not a folder"
    if kind == "folder to create" and os.path.isdir(os.path.dirname(path.rstrip("/")) or "/"):
        return None
    return "does not exist, nor does its parent folder" if kind == "folder to create" else "does not exist"


def _remote_path_problem(config: SlurmConfig, path: str, kind: PathKind) -> str | None:
    from posttrain.cluster.shell import SshShell

    test = "-f" if kind == "file" else "-d"
    parent = os.path.dirname(path.rstrip("/")) or "/"
    script = f"test {test} {shlex.quote(path)}"
    if kind == "folder to create":
        script = f"{script} || {{ test ! -e {shlex.quote(path)} && test -d {shlex.quote(parent)}; }}"
    if kind == "model folder":
        script = f"{script} && test -f {shlex.quote(os.path.join(path, MODEL_CONFIG))}"
    result = SshShell(config.ssh_host).run(["sh", "-c", script], check=False, timeout=60)  # type: ignore[arg-type]
    if result.returncode == 0:
        return None
    return {"file": "is not a file there", "model folder": f"is not a model folder there (a folder with "
            f"{MODEL_CONFIG})"}.get(kind, "is not a folder there")


def check_launcher(config: ClusterConfig) -> str | None:
    """``ConfigError`` (field ``launcher``) when the launcher's program is not on the job's PATH.
    Local: looked up in the job's environment. Slurm: a one-task ``srun`` probe on a node of the
    cluster's partition, in its image, after its env and setup_commands (cached per settings).
    Kubernetes: the image's business, not checked. Returns why nothing was checked when a Slurm
    probe could not tell (for the run's log), else None."""
    program = LAUNCHER_PROGRAMS.get(config.launcher)
    if program is None or config.dry_run:
        return None  # launcher python: the command itself starts, as written
    if isinstance(config, LocalConfig):
        _check_local(config, program)
    elif isinstance(config, SlurmConfig):
        return _check_slurm(config, program)
    return None


def _check_local(config: LocalConfig, program: str) -> None:
    # the job's PATH as the local backend builds it: the submitter's Python folder first
    path = config.env.get("PATH") or os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    if config.setup_commands:  # they may put it on the PATH (a venv's activate): ask the job's shell after them
        script = " && ".join([*config.setup_commands, f"command -v {program}"])
        try:  # the job's shell by its path, as the job runs it: the job's PATH need not hold bash
            found = subprocess.run([JOB_SHELL, "-c", script], env={**os.environ, **config.env, "PATH": path},
                                   capture_output=True, timeout=60).returncode == 0
        except OSError as e:
            raise ConfigError("setup_commands", f"cannot run {JOB_SHELL}, the shell that runs them "
                              f"({e.strerror or e})") from None
        except subprocess.TimeoutExpired:
            raise ConfigError("setup_commands", "did not finish within 60 s on this machine (run to find the "
                              f"launcher {program} after them)") from None
    else:
        found = shutil.which(program, path=path) is not None
    if not found:
        after = ", after setup_commands" if config.setup_commands else ""
        raise ConfigError("launcher", f"{program} is not on the job's PATH on this machine "
                          f"(the Python folder {os.path.dirname(sys.executable)}, then $PATH{after}); "
                          "install it there, or use launcher: python")


def probe_command(config: SlurmConfig, program: str) -> list[str]:
    """The srun line of the Slurm probe: one task on one node of the job's partition, account and
    qos, in the job's container, running what the job's node.sh runs before it (env_file, env,
    setup_commands), then ``command -v`` the launcher."""
    args = ["srun", "--job-name=posttrain-launcher-probe", "--nodes=1", "--ntasks=1", "--time=1",
            f"--immediate={PROBE_WAIT_S}", "--mem=256M"]
    args += [f"--{k}={v}" for k, v in (("partition", config.partition), ("account", config.account),
                                        ("qos", config.qos)) if v]
    if config.image:
        args += [f"--container-image={config.image}",
                 f"--container-mounts={','.join(f'{p}:{p}' for p in config.shared_roots)}",
                 "--no-container-mount-home"]
    lines = []
    if config.env_file:
        lines += ["set -a", f"source {shlex.quote(config.env_file)}", "set +a"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(config.env.items())]
    lines += [*config.setup_commands, f"command -v {program} || {{ echo {MISSING}; exit 3; }}"]
    return [*args, "bash", "-c", "\n".join(lines)]


def _check_slurm(config: SlurmConfig, program: str) -> str | None:
    key = config.model_dump_json(exclude={"poll_interval_s", "dry_run"})
    if key not in _probed:
        outcome, note = _probe_slurm(config, program)
        if outcome is None:
            return note  # no answer: not checked, the job itself will tell
        _probed[key] = outcome
    if _probed[key]:
        raise ConfigError("launcher", _probed[key])  # type: ignore[arg-type]
    return None


def _probe_slurm(config: SlurmConfig, program: str) -> tuple[str | None, str]:
    """('', '') when found, (the error message, '') when missing, (None, why) when the probe
    could not tell."""
    from posttrain.cluster.shell import LocalShell, SshShell

    shell = SshShell(config.ssh_host) if config.ssh_host else LocalShell()
    try:
        result = shell.run(probe_command(config, program), check=False, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, redact.scrub(f"launcher {config.launcher} not checked: the srun probe did not answer ({e})")
    out = result.stdout.decode(errors="replace")
    if result.returncode == 0 and out.strip():
        return "", ""
    if MISSING in out:
        where = f"partition {config.partition}" if config.partition else "the default partition"
        inside = f", in image {config.image}" if config.image else ""
        return (f"{program} is not on the nodes' PATH ({where}{inside}, after env_file, env and "
                "setup_commands; srun probe); install it there, add it through setup_commands, or use launcher: "
                "python"), ""
    reason = " ".join(result.stderr.decode(errors="replace").split())[-300:]
    return None, redact.scrub(f"launcher {config.launcher} not checked: the srun probe failed "
                              f"(exit {result.returncode}: {reason})")


def check_model_ref(config: ClusterConfig, name: str, value: str, block: str | None = None) -> None:
    """A model the job loads by ``from_pretrained``: an absolute path is checked as a model folder
    (``check_paths``); anything else must be a Hugging Face hub id, which the job downloads."""
    if value.startswith("/"):
        check_paths(config, {name: (value, "model folder")}, block=block)
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        raise ConfigError(name, f"{value!r} is neither an absolute path (a model folder) nor a Hugging Face "
                                "hub id (org/name)") from None


def check_reachable(name: str, address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """``ConfigError`` naming ``name`` when nothing accepts a TCP connection at a Dask-style address
    (``tcp://host:port``, ``tls://``, ``ws://``, ``wss://``) within ``timeout_s``. A ``ucx://``
    address is not TCP: not checked (returns why, for the run's log)."""
    from distributed.comm.addressing import parse_address, parse_host_port

    scheme, location = parse_address(address)
    if scheme == "ucx":
        return f"{name} {address} not checked (ucx is not TCP)"
    host, port = parse_host_port(location)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:  # refused, unreachable, no such host, or no answer in time (TimeoutError)
        why = e.strerror or ("no answer in time" if isinstance(e, TimeoutError) else str(e) or type(e).__name__)
        raise ConfigError(name, f"nothing answers at {address} ({why}, waited at most {timeout_s:g} s); "
                                "start the scheduler or fix the address") from None
