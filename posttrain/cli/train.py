"""``posttrain stage``, ``posttrain train`` and ``posttrain watch``: put a dataset on shared storage,
run the trainer where users train (Slurm, Kubernetes, this machine), follow a run's checkpoints."""

from __future__ import annotations

import argparse
import sys

BACKENDS = ("slurm", "k8s", "local")


def register(subparsers: argparse._SubParsersAction) -> None:
    stage = subparsers.add_parser(
        "stage",
        help="validate a prompt dataset and copy it, content-addressed, onto shared storage",
        description="Validate every row of a JSONL or Parquet prompt file and stage it as "
        "DEST/datasets/<digest>/{data.jsonl,manifest.json}. Prints the manifest path.",
    )
    stage.add_argument("source", help="local .jsonl/.ndjson or .parquet/.pq file of conversational prompts")
    stage.add_argument("--dest", required=True, help="absolute folder on shared storage")
    stage.add_argument("--json", action="store_true", help="print the whole StagedDataset as JSON")
    stage.set_defaults(func=_stage)

    train = subparsers.add_parser(
        "train",
        help="run the trainer on Slurm, Kubernetes or this machine and stream its checkpoints",
        description="Submit python -m posttrain.trainer with the trainer: section of SETTINGS to the backend "
        "its cluster: section describes (see posttrain.runs.job). Prints the job id, log path and each "
        "state change on stderr, and one JSON line per newly complete checkpoint, in step order, on stdout. "
        "Ctrl-C cancels the job. Exit status 0 when training completed, 1 when the job did not, 2 for bad settings.",
    )
    train.add_argument("settings", help="YAML file with cluster: and trainer: sections")
    train.add_argument("--backend", choices=BACKENDS, help="overrides the file's backend: (default local)")
    train.add_argument(
        "--dry-run", action="store_true",
        help="print the sbatch script, srun line and trainer.yaml (Slurm) or the manifests (Kubernetes); "
        "contact nothing",
    )  # fmt: skip
    train.add_argument("--cursor", help="watch position file (default ~/.cache/posttrain/watch/<name>-<run id>.json)")
    train.set_defaults(func=_train)

    watch = subparsers.add_parser(
        "watch",
        help="print each complete checkpoint of a training output folder once, in step order",
        description="Follow OUTPUT_DIR and print one JSON line per complete checkpoint-<step>. "
        "The cursor file remembers the last one, so a restarted watch continues after it.",
    )
    watch.add_argument("output_dir", help="the trainer's output_dir")
    watch.add_argument("--cursor", required=True, help="JSON file holding the watch position")
    watch.add_argument("--poll", type=float, default=5.0, help="seconds between scans (default 5)")
    end = watch.add_mutually_exclusive_group()
    end.add_argument("--once", action="store_true", help="print what is complete now, then exit")
    end.add_argument("--done-file", help="exit once this file exists and every checkpoint is printed")
    watch.set_defaults(func=_watch)


def _stage(args: argparse.Namespace) -> int:
    from posttrain.datasets.staging import StagingError, stage_dataset

    try:
        staged = stage_dataset(args.source, args.dest)
    except StagingError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(staged.model_dump_json(indent=2))
    else:
        note = "already staged" if staged.already_staged else "staged"
        print(f"{note}: {staged.manifest.rows} rows, sha256 {staged.manifest.digest}", file=sys.stderr)
        print(staged.manifest_path)
    return 0


def _train(args: argparse.Namespace) -> int:
    from posttrain import redact
    from posttrain.cli import UsageError
    from posttrain.cluster import ConfigError, SubmissionError, open_backend
    from posttrain.runs.follow import TrainingFailed, submit_training
    from posttrain.runs.job import load_training_settings, training_job_spec

    try:
        config = load_training_settings(args.settings, args.backend, args.dry_run)
        if config.cluster.dry_run:
            print(open_backend(config.cluster).render(training_job_spec(config)), end="")
            return 0
        run = submit_training(config)
    except ConfigError as e:
        raise UsageError(f"{args.settings}:\n{e}") from None
    except SubmissionError as e:
        print(f"posttrain: submission failed: {redact.scrub(e)}", file=sys.stderr)
        return 1
    print(f"submitted {run.job_id}; log: {run.log_path}", file=sys.stderr)
    if run.watch_dir is not None:
        print(f"watching {run.watch_dir} for checkpoints", file=sys.stderr)

    def on_state(state) -> None:
        print(f"job {run.job_id}: {state.value}", file=sys.stderr, flush=True)

    def on_skip(skipped) -> None:
        print(f"skipped: {skipped.path} ({skipped.reason})", file=sys.stderr)

    try:
        with run.handle:  # Ctrl-C (KeyboardInterrupt) cancels the job on the way out
            for info in run.checkpoints(cursor_path=args.cursor, on_state=on_state, on_skip=on_skip):
                print(info.model_dump_json(), flush=True)
    except TrainingFailed as e:
        print(f"job {run.job_id} ended {e.state}\nreason: {redact.scrub(e.reason)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"cancelled job {run.job_id}", file=sys.stderr)
        raise
    results = run.results()
    summary = f": global_step {results[-1].global_step}, last checkpoint {results[-1].checkpoint}" if results else ""
    print(f"job {run.job_id} ended COMPLETED{summary}", file=sys.stderr)
    return 0


def _watch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from posttrain.cli import UsageError
    from posttrain.polling import MIN_POLL_S
    from posttrain.runs.watch import watch_checkpoints

    if not MIN_POLL_S <= args.poll < float("inf"):  # NaN fails too
        raise UsageError(f"--poll {args.poll:g}: must be at least {MIN_POLL_S} seconds (and finite)")
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"{output_dir} is not a folder")
    if args.once and not output_dir.exists():  # a running watch waits for the trainer to create it
        raise UsageError(f"{output_dir} does not exist")
    if args.once:
        is_done = lambda: True  # noqa: E731
    elif args.done_file:
        done_file = Path(args.done_file)
        is_done = done_file.exists
    else:
        is_done = lambda: False  # noqa: E731
    try:
        for info in watch_checkpoints(
            args.output_dir,
            cursor_path=args.cursor,
            is_job_done=is_done,
            poll_interval=args.poll,
            on_skip=lambda s: print(f"skipped: {s.path} ({s.reason})", file=sys.stderr),
        ):
            print(info.model_dump_json(), flush=True)
    except ValueError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    if not output_dir.is_dir():  # the job ended (--done-file) and never created it
        raise UsageError(f"{output_dir} does not exist")
    return 0
