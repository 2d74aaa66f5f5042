"""``posttrain publish``: publish checkpoints as a snapshot chain in an object store.

Each checkpoint's step is ``checkpoint-<N>`` in its folder's name, else ``global_step`` of its
``trainer_state.json``, else ``--step`` (one checkpoint only). A step published before with the
same weights is reported and skipped; with other weights it is an error. One publisher works in a
work folder at a time: a second one fails at once naming the holder's pid, or waits up to
``--lock-timeout`` seconds. Every error is one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.chain.format import MAX_CHAIN_DELTAS
from posttrain.cli.s3_args import add_s3_options, s3_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="publish checkpoints, in step order, as a chain in an object store")
    p.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint folders (ordered by step)")
    p.add_argument("--store", required=True, help="s3://bucket/prefix (the deployment's hot-load bucket and "
                   "prefix) or a folder")
    p.add_argument("--run", required=True, help="run name; part of every identity (letters, digits, '_', '.', '-')")
    p.add_argument("--work-dir", type=Path, required=True, help="local scratch: spool queue, base, staging")
    p.add_argument("--step", type=int, help="the step of the (one) checkpoint, when its folder does not say")
    p.add_argument("--flavor", choices=["coreweave", "slime"], default="coreweave")
    p.add_argument("--max-deltas", type=int, default=MAX_CHAIN_DELTAS,
                   help=f"deltas after a full snapshot before the next full one (at most {MAX_CHAIN_DELTAS}); "
                   "fixed for a run on its first publication")
    p.add_argument("--delta-budget", type=float, default=1.0)
    p.add_argument("--sync", action="store_true", help="publish each checkpoint before taking the next")
    p.add_argument("--lock-timeout", type=float, default=0.0,
                   help="seconds to wait for another publisher to leave the work dir (default: fail at once)")
    add_s3_options(p, part_size=True)
    p.set_defaults(func=cmd_publish)


OPTION_NAMES = {"run": "--run", "max_deltas": "--max-deltas", "delta_budget": "--delta-budget",
                "policy.max_deltas": "--max-deltas", "policy.delta_budget": "--delta-budget",
                "lock_timeout": "--lock-timeout", "work_dir": "--work-dir"}


def _steps(args: argparse.Namespace) -> list[tuple[int, Path]]:
    """(step, checkpoint) in step order; a missing folder, an unknown or a repeated step is an error."""
    from posttrain.chain.ops import checkpoint_step
    from posttrain.cli import UsageError

    for ckpt in args.checkpoints:
        if not ckpt.is_dir():
            raise UsageError(f"checkpoint {ckpt} {'is not a folder' if ckpt.exists() else 'does not exist'}")
    if args.step is not None:
        if len(args.checkpoints) != 1:
            raise UsageError(f"--step names the step of one checkpoint, not of {len(args.checkpoints)}")
        if args.step < 0:
            raise UsageError(f"--step {args.step}: must be 0 or more")
        return [(args.step, args.checkpoints[0])]
    found: dict[int, Path] = {}
    for ckpt in args.checkpoints:
        step = checkpoint_step(ckpt)
        if step in found:
            raise UsageError(f"{found[step]} and {ckpt} are both step {step}")
        found[step] = ckpt
    return sorted(found.items())


def cmd_publish(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from posttrain.chain.policy import ChainPolicy
    from posttrain.cli import UsageError
    from posttrain.cli.chain import human_bytes
    from posttrain.errors import describe_os_error, describe_validation_error, file_in_the_way
    from posttrain.publish import PublishConfig, Publisher
    from posttrain.storage import open_store

    try:
        config = PublishConfig(run=args.run, work_dir=args.work_dir.resolve(), flavor=args.flavor,
                               policy=ChainPolicy(max_deltas=args.max_deltas, delta_budget=args.delta_budget),
                               async_publish=not args.sync, lock_timeout=args.lock_timeout)
    except ValidationError as e:
        raise UsageError(describe_validation_error(e, OPTION_NAMES)) from None
    if (file := file_in_the_way(config.work_dir)) is not None:  # named as posttrain serve names it
        where = "" if file == config.work_dir else f"{file} "
        raise UsageError(f"work_dir (--work-dir) {config.work_dir}: {where}is a file, not a folder")
    steps = _steps(args)
    options = s3_options(args)

    def report(p) -> None:
        print(f"published {p.kind} {p.identity} (step {p.step}): {human_bytes(p.stored_bytes)}, "
              f"{100 * p.stored_bytes / max(p.raw_bytes, 1):.2f}% of full, uploaded {human_bytes(p.uploaded_bytes)}",
              flush=True)

    try:
        with open_store(args.store, **options) as store, Publisher(store, config, on_published=report) as publisher:
            publisher.resume()  # whatever a previous run left spooled
            for step, ckpt in steps:
                claim = publisher.submit(ckpt, step)
                if claim is not None:
                    print(f"already published: {ckpt} (step {step}) as {claim.identity}, same weights", flush=True)
            publisher.drain()
    except OSError as e:  # a full disk, a folder we may not write: the path and the reason
        raise UsageError(describe_os_error(e)) from None
    return 0
