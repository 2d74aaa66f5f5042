"""``posttrain stage`` and ``posttrain watch``: put a dataset on shared storage, follow a run's checkpoints."""

from __future__ import annotations

import argparse
import sys


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


def _watch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from posttrain.cli import UsageError
    from posttrain.watch import watch_checkpoints

    if args.poll <= 0:
        raise UsageError("--poll must be a positive number of seconds")
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
    return 0
