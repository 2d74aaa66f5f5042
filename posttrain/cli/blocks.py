"""``posttrain blocks save --from blocks.yaml``: save a site's blocks on the Prefect server.

The file maps ``<block type>/<name>`` to the block's fields; secrets are named by environment
variable (``token: {env: GATEWAY_TOKEN}``), never written in it. ``examples/blocks.yaml`` has every
field a site sets; ``docs/site-setup.md`` walks through it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("blocks", help="save posttrain's blocks (cluster, store, inference) from a YAML file")
    blocks = p.add_subparsers(dest="blocks_command", metavar="COMMAND", required=True)
    save = blocks.add_parser(
        "save", help="validate the file's blocks, then save (overwrite) them on the Prefect server",
        description="Save every block of FILE (<block type>/<name>: fields) on the server of PREFECT_API_URL. "
        "Secret fields are given as {env: NAME} and read from the environment now. Nothing is saved unless every "
        "block is valid.",
    )
    save.add_argument("--from", dest="path", type=Path, required=True, metavar="FILE",
                      help="YAML file of blocks, e.g. examples/blocks.yaml")
    save.add_argument("--check", action="store_true",
                      help="validate the file and read its secrets' variables; contact no server, save nothing")
    save.set_defaults(func=cmd_save)


def cmd_save(args: argparse.Namespace) -> int:
    from posttrain.cli import UsageError
    from posttrain.pipeline.deployments.setup import PrefectUnreachable, require_server
    from posttrain.pipeline.deployments.site_blocks import BlocksFileError, describe, load_blocks_file, save_blocks

    try:
        blocks = load_blocks_file(args.path)
    except BlocksFileError as e:
        raise UsageError(str(e)) from None
    if args.check:
        for site in blocks:
            print(f"valid: {describe(site)}")
        return 0
    try:
        require_server()
    except PrefectUnreachable as e:
        raise UsageError(str(e)) from None
    for line in save_blocks(blocks):
        print(f"saved: {line}")
    return 0
