"""``posttrain automations install FILE --block TYPE/NAME``: create the automations of FILE with
their notifications sent to a named block (``docs/site-setup.md``)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("automations", help="install posttrain's Prefect automations (automations/*.yaml)")
    commands = p.add_subparsers(dest="automations_command", metavar="COMMAND", required=True)
    install = commands.add_parser(
        "install", help="create the automations of FILE, notifying the block --block names",
        description="Fill every action's block_document_id with the id of --block (a notification block: "
        "Slack, Teams, custom webhook, ...), then create the automations on the server of PREFECT_API_URL, "
        "replacing those of the same name (only once every one was accepted). Without --block, every id in FILE "
        "must be a notification block of that server; a placeholder is refused.",
    )
    install.add_argument("file", help="automation YAML, e.g. automations/hotload-failed.yaml")
    install.add_argument("--block", metavar="TYPE/NAME",
                         help="the notification block, as prefect block ls names it (e.g. slack-webhook/ops)")
    install.set_defaults(func=cmd_install)


def cmd_install(args: argparse.Namespace) -> int:
    from posttrain.cli import UsageError
    from posttrain.pipeline.deployments.automations import (
        AutomationFileError,
        check_block_ids,
        fill_block_ids,
        install,
        notification_block_id,
        read_automations,
    )
    from posttrain.pipeline.deployments.setup import PrefectUnreachable, require_server

    try:
        automations = read_automations(args.file)
        if args.block is None:
            automations = fill_block_ids(args.file, automations, None)  # refuses a placeholder before any call
        require_server()
        if args.block is not None:
            automations = fill_block_ids(args.file, automations, notification_block_id(args.block))
        else:  # ids written in the file: each must be a notification block of this server
            check_block_ids(args.file, automations)
        for name, automation_id, replaced in install(args.file, automations):
            print(f"installed automation {name!r} ({automation_id})" + (f", replacing {replaced}" if replaced else ""))
    except (AutomationFileError, PrefectUnreachable) as e:
        raise UsageError(str(e)) from None
    return 0
