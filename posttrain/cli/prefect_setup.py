"""``posttrain prefect-setup``: register block types and create work pools on a Prefect server."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefect-setup", help="register posttrain's block types and create its work pools")
    p.add_argument("--no-kubernetes-pool", action="store_true", help="create only the process work pool")
    p.add_argument("--default-store", type=Path,
                   help="also save the embedded default blocks: local cluster and this folder as the store")
    p.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                   help="mark a posttrain flow run Crashed after this many seconds without a heartbeat (a lost "
                   "worker), so it can be retried; more than 30 (the seconds between heartbeats), default 90")
    p.set_defaults(func=cmd_setup)


def cmd_setup(args: argparse.Namespace) -> int:
    from posttrain.cli import UsageError
    from posttrain.pipeline.deployments.recovery import delete_old_automation
    from posttrain.pipeline.deployments.setup import PrefectUnreachable, create_pools, register_blocks, require_server
    from posttrain.pipeline.deployments.unresponsive import (
        AUTOMATION_NAME,
        DEFAULT_TIMEOUT_S,
        check_timeout,
        install_unresponsive_runs_automation,
    )

    timeout = DEFAULT_TIMEOUT_S if args.heartbeat_timeout is None else args.heartbeat_timeout
    try:  # before anything is changed on the server
        check_timeout(timeout)
    except ValueError as e:
        raise UsageError(f"--heartbeat-timeout {e}") from None
    try:
        require_server()
    except PrefectUnreachable as e:
        raise UsageError(str(e)) from None
    print("block types:", ", ".join(register_blocks()))
    print("work pools:", ", ".join(create_pools(kubernetes=not args.no_kubernetes_pool)))
    install_unresponsive_runs_automation(timeout)
    print(f"automation: {AUTOMATION_NAME} (a run without a heartbeat for {timeout} s is marked Crashed)")
    if delete_old_automation():
        print("automation: posttrain-retry-crashed-runs deleted (it could retry a run twice after a server "
              "restart): `posttrain recover` retries Crashed runs now")
    print("Crashed runs are retried by `posttrain recover`: run it beside the worker (docs/recovery.md)")
    if args.default_store is not None:
        from posttrain.pipeline.blocks import LocalCluster, ObjectStore

        LocalCluster().save("default", overwrite=True)
        ObjectStore(uri=str(args.default_store.resolve())).save("default", overwrite=True)
        print("default blocks: posttrain-local-cluster/default, posttrain-object-store/default")
    return 0
