"""``posttrain gc``: retention across the runs of a store (docs/retention.md).

Names the versions protected besides the kept runs' (``--protect``, the promotion histories in
the store) and why, lists what the rule deletes (run, identity, kind, step, bytes) and the total,
then deletes it newest first with a progress bar; ``--dry-run`` stops after the list. Bad input (no rule or
both, a count or age not above 0, a store that is not there, a protected identity the store does
not have, a promotion history record that cannot be read) is one line on stderr, exit status 2,
with nothing deleted. Runs that are being
published, and every run while a promotion or rollback holds a production deployment's lease
(docs/promotion.md), are skipped and named; the exit status is still 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.cli.s3_args import add_s3_options, s3_options
from posttrain.words import plural


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="delete the chains of old runs from a store, keeping what is protected",
                       description="Keep the newest --keep-runs runs (or those published within --keep-days) whole; "
                       "of the other runs delete every snapshot that no protected version needs.")
    p.add_argument("--store", required=True, help="s3://bucket/prefix, file:///path or a folder")
    p.add_argument("--prefix", default="", help="prefix in the store where the chains and their ledgers are")
    p.add_argument("--keep-runs", type=int, metavar="N", help="keep the newest N runs whole (N >= 1)")
    p.add_argument("--keep-days", type=float, metavar="D", help="keep whole every run that published within D days")
    p.add_argument("--protect", action="append", default=[], metavar="IDENTITY",
                   help="a version to keep with its chain prefix, whatever its run (repeat for more)")
    p.add_argument("--protect-file", type=Path, action="append", default=[], metavar="FILE",
                   help="a file of identities to protect, one per line ('#' starts a comment)")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    add_s3_options(p)
    p.set_defaults(func=cmd_gc)


OPTION_NAMES = {"keep_runs": "--keep-runs", "keep_days": "--keep-days", "protect": "--protect"}


def _protected(args: argparse.Namespace) -> set[str]:
    from posttrain.cli import UsageError

    found = {p.strip() for p in args.protect if p.strip()}
    for path in args.protect_file:
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise UsageError(f"--protect-file {path}: {e.strerror}") from None
        found.update(s for line in lines if (s := line.split("#", 1)[0].strip()))
    return found


def _check_folder(uri: str) -> None:
    """A folder store must exist: opening it would create it, and gc must not create stores."""
    from urllib.parse import unquote, urlsplit

    from posttrain.cli import UsageError

    if uri.startswith("s3://"):
        return
    path = Path(unquote(urlsplit(uri).path)) if uri.startswith("file://") else Path(uri)
    if not path.is_dir():
        raise UsageError(f"--store {uri}: {'not a folder' if path.exists() else 'no such folder'}")


def cmd_gc(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from posttrain.cli import UsageError
    from posttrain.cli.chain import human_bytes, make_console, progress_bar
    from posttrain.errors import describe_validation_error
    from posttrain.publish.gc import GcConfig, plan_gc, run_gc
    from posttrain.storage import open_store
    from posttrain.storage.prefixed import under

    if (args.keep_runs is None) == (args.keep_days is None):
        raise UsageError("give --keep-runs N or --keep-days D (exactly one)")
    try:
        config = GcConfig(keep_runs=args.keep_runs, keep_days=args.keep_days, protect=_protected(args))
    except ValidationError as e:
        raise UsageError(describe_validation_error(e, OPTION_NAMES)) from None
    _check_folder(args.store)
    options = s3_options(args)
    console = make_console()
    with open_store(args.store, **options) as base:
        store = under(base, args.prefix)
        plan = plan_gc(store, config)
        if not plan.runs:
            print(f"{store.uri}: no runs with published snapshots; nothing to do")
            return 0
        kept = [r.run for r in plan.runs if r.kept]
        print(f"{store.uri}: {plural(len(plan.runs), 'run')}; kept whole: {', '.join(kept) or '(none)'}")
        _print_roots(plan)
        if not plan.doomed:
            print("nothing to delete")
            return 0
        console.print(_table(plan, human_bytes))
        if args.dry_run:
            print(f"dry run: {plural(len(plan.doomed), 'snapshot')}, {human_bytes(plan.total_bytes)} "
                  f"({plan.total_bytes} bytes) would be freed; nothing was deleted")
            return 0
        with progress_bar("deleting", plan.total_bytes) as advance:
            result = run_gc(store, plan, progress=lambda d: advance(d.bytes))
    for run, why in result.skipped.items():
        print(f"skipped {why}")
    freed = result.freed_bytes
    print(f"deleted {plural(len(result.deleted), 'snapshot')}, freed {human_bytes(freed)} ({freed} bytes)")
    return 0


def _print_roots(plan) -> None:  # noqa: ANN001 - a GcPlan
    """The versions kept besides those of the kept runs (each with its chain prefix), and why."""
    for identity, why in plan.held_back().items():
        print(f"protected: {identity} ({why})")
    for identity, why in sorted(plan.absent.items()):
        print(f"not in the store, nothing to keep: {identity} ({why})")


def _table(plan, human_bytes):  # noqa: ANN001, ANN202 - a GcPlan and chain.human_bytes; a rich Table
    from rich.table import Table

    table = Table(title=f"gc {plan.store}: to delete, in this order")
    for col in ("run", "identity", "kind", "step", "bytes"):
        table.add_column(col, justify="right" if col in ("step", "bytes") else "left")
    for d in plan.doomed:
        table.add_row(d.run, d.identity, d.kind, str(d.step), human_bytes(d.bytes))
    table.caption = f"total: {plural(len(plan.doomed), 'snapshot')}, {human_bytes(plan.total_bytes)} freed"
    return table
