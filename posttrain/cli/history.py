"""``posttrain history``: a production deployment's promotion history (docs/promotion.md).

A table of its records (promotions, refusals, rollbacks; the gate's means when there is a
decision), then the champion and what ``posttrain rollback --to previous`` would restore.
``--json`` prints the records as JSON lines instead, oldest first.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from posttrain.cli.rollback import add_store_options

    p = sub.add_parser("history", help="a production deployment's promotions, refusals and rollbacks",
                       description="Print the promotion history of a deployment, kept next to the chain under "
                       "<prefix>/.posttrain/promotions/<deployment>/, with its champion and what rollback --to "
                       "previous would restore.")
    add_store_options(p)
    p.add_argument("--deployment", required=True, metavar="ID", help="the production deployment whose history to show")
    p.add_argument("--json", action="store_true", help="the records as JSON lines, oldest first")
    p.set_defaults(func=cmd_history)


def _mean(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def cmd_history(args: argparse.Namespace) -> int:
    import sys

    from posttrain.cli import UsageError
    from posttrain.cli.chain import make_console
    from posttrain.cli.rollback import check_deployment_option, open_history_store
    from posttrain.promote.history import History, HistoryError, champions

    deployment = check_deployment_option(args.deployment)
    with open_history_store(args) as store:
        history = History(store, "", deployment)
        try:
            records = history.records()
        except HistoryError as e:
            raise UsageError(f"--deployment {deployment}: {e}") from None
        uri = store.uri
    if args.json:
        for r in records:
            print(r.model_dump_json())
        return 0
    if not records:
        print(f"{uri}: deployment {deployment} has no promotion history (no records under {history.folder})")
        return 0
    from rich.table import Table

    table = Table(title=f"promotion history of {deployment} in {uri}")
    longest = max(len(i) for r in records for i in (r.identity, r.previous or "-"))
    for col in ("seq", "kind", "identity", "previous", "run", "at", "reason", "candidate", "champion"):
        whole = {"min_width": longest, "no_wrap": True} if col in ("identity", "previous") else {}
        table.add_column(col, justify="right" if col in ("seq", "candidate", "champion") else "left",
                         overflow="fold", **whole)  # identities are never cut: they are what to copy
    for r in records:
        d = r.decision
        table.add_row(str(r.seq), r.kind, r.identity, r.previous or "-", r.run or "-",
                      r.at.strftime("%Y-%m-%d %H:%M:%SZ"), r.reason, _mean(d.candidate_mean if d else None),
                      _mean(d.champion_mean if d else None))
    console = make_console()
    if not sys.stdout.isatty():  # a file or a pipe: room for both identities, the reason and the means
        console.width = max(console.width, 2 * longest + 140)
    console.print(table)
    stack = champions(records)
    print(f"champion: {stack[-1] if stack else 'none'}")
    print(f"rollback --to previous would restore: {stack[-2] if len(stack) > 1 else 'nothing (no earlier champion)'}")
    return 0
