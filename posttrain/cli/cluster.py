"""``posttrain submit``: run a job on Slurm, Kubernetes or this machine from one YAML file.

    backend: slurm            # or k8s / local; --backend overrides it
    cluster:                  # the backend's settings (SlurmConfig, KubernetesConfig, LocalConfig)
      shared_dir: /mnt/shared
      image: docker://ghcr.io#org/posttrain:latest
      nodes: 2
    job:                      # JobSpec
      name: grpo-nightly
      command: [python, -m, posttrain.trainer, "{job_dir}/trainer.yaml"]
      files_from: {trainer.yaml: ./trainer.yaml}   # local files shipped into the job folder
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

BACKENDS = ("slurm", "k8s", "local")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submit",
        help="submit a job to Slurm, Kubernetes or this machine and follow it to the end",
        description="Submit the job: section of CONFIG to the backend its cluster: section describes, "
        "print the job id and log, wait for the end and print the log's tail (Kubernetes: stream every "
        "rank's log). Ctrl-C cancels the job. Exit status 0 when the job completed, 1 otherwise.",
    )
    p.add_argument("config", help="YAML file with cluster: and job: sections")
    p.add_argument("--backend", choices=BACKENDS, help="overrides the file's backend: (default local)")
    p.add_argument("--dry-run", action="store_true", help="print everything that would be submitted, submit nothing")
    p.add_argument("--detach", action="store_true", help="print the job id and log path, then exit")
    p.add_argument("--tail", type=int, default=40, help="log lines printed when the job ends (default 40)")
    p.set_defaults(func=_submit)


def load_submission(path: str, backend: str | None = None, dry_run: bool = False) -> tuple[Any, Any]:
    """(cluster config, JobSpec) from a submit YAML; ``UsageError`` names the bad field."""
    from pathlib import Path

    import yaml
    from pydantic import ValidationError

    from posttrain.cli import UsageError
    from posttrain.cluster import JobSpec, describe_validation_error, parse_cluster_config

    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a mapping with cluster: and job: sections")
    unknown = sorted(set(doc) - {"backend", "cluster", "job"})
    if unknown:
        raise UsageError(f"{path}: unknown section(s) {', '.join(unknown)}; expected backend, cluster, job")
    defaulted = not (backend or doc.get("backend"))
    backend = backend or doc.get("backend") or "local"
    if backend not in BACKENDS:
        raise UsageError(f"{path}: backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    cluster = dict(doc.get("cluster") or {})
    job = dict(doc.get("job") or {})
    if dry_run:
        cluster["dry_run"] = True
    files = dict(job.get("files") or {})
    for name, local in (job.pop("files_from", None) or {}).items():
        source = Path(path).parent / str(local)
        try:
            files[name] = source.read_text()
        except OSError as e:
            raise UsageError(f"job.files_from.{name}: {e}") from None
    if files:
        job["files"] = files
    try:
        config = parse_cluster_config(backend, cluster)
    except (ValidationError, ValueError) as e:
        from posttrain.runs.job import DEFAULTED_TO_LOCAL

        note = f"\n{DEFAULTED_TO_LOCAL}" if defaulted else ""
        raise UsageError(f"{path}:\n{describe_validation_error(e, 'cluster')}{note}") from None
    try:
        spec = JobSpec.model_validate(job)
    except ValidationError as e:
        raise UsageError(f"{path}:\n{describe_validation_error(e, 'job')}") from None
    return config, spec


def _submit(args: argparse.Namespace) -> int:
    from posttrain import redact
    from posttrain.cli import UsageError
    from posttrain.cluster import ConfigError, JobState, SubmissionError, open_backend

    config, spec = load_submission(args.config, args.backend, args.dry_run)
    backend = open_backend(config)
    try:
        if config.dry_run:
            print(backend.render(spec), end="")
            return 0
        handle = backend.submit(spec)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except SubmissionError as e:
        print(f"posttrain: submission failed: {redact.scrub(e)}", file=sys.stderr)
        return 1
    print(f"submitted {handle.job_id}; log: {handle.log_path}", file=sys.stderr)
    if args.detach:
        print(handle.job_id)
        return 0
    write = lambda text: sys.stdout.write(redact.scrub(text))  # noqa: E731
    follower = handle.follow_logs(write) if hasattr(handle, "follow_logs") else None
    with handle:  # Ctrl-C (KeyboardInterrupt) cancels the job on the way out
        state = handle.wait()
    if follower is not None:
        follower.stop()
    elif args.tail > 0:
        print(redact.scrub(handle.tail_log(args.tail)), end="")
    print(f"job {handle.job_id} ended {state.value}", file=sys.stderr)
    if state != JobState.COMPLETED:
        reason = handle.failure_reason()
        if reason:
            print(f"reason: {redact.scrub(reason)}", file=sys.stderr)
        return 1
    return 0
