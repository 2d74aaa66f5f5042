"""``posttrain recover``: retry Crashed posttrain flow runs without a person (docs/recovery.md).

Run it beside the worker, under the same supervisor, one per Prefect server: every ``--every``
seconds it retries each Crashed posttrain run of a deployment at most ``--retries`` times
(``AwaitingRetry``, as ``prefect flow-run retry`` does), sets Crashed a run left Pending longer
than ``--pending-timeout`` (its flow-run process never started), and says on stdout what it did.
The logic is ``posttrain.pipeline.deployments.recovery``.
"""

from __future__ import annotations

import argparse


# posttrain.pipeline.deployments.recovery's defaults, written here: parsing must not import pydantic
# (tests/chain/test_cli.py); tests/pipeline/test_recover.py checks they agree
DEFAULT_RETRIES, MAX_RETRIES, TAG, DEFAULT_HEARTBEAT_TIMEOUT_S = 3, 20, "posttrain", 90.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recover", help="retry Crashed posttrain flow runs without a person, a bounded number of "
                       "times (run it beside the worker, under a supervisor)")
    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES, metavar="N",
                   help=f"retries of one Crashed run, 0 to {MAX_RETRIES} (0: never; a person retries), "
                   f"default {DEFAULT_RETRIES}; past them a posttrain.flow-run.left-crashed event is emitted")
    p.add_argument("--pending-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a run Pending this long (its flow-run process never reported Running) is set Crashed, "
                   "then retried; default 600")
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="SECONDS",
                   help="a Running run of a deployment with no heartbeat this long is set Crashed, then retried; "
                   f"0: never (work pools without heartbeats); default {DEFAULT_HEARTBEAT_TIMEOUT_S:g}; not with --once")
    p.add_argument("--every", type=float, default=30.0, metavar="SECONDS", help="seconds between sweeps, default 30 "
                   "(at most a third of --heartbeat-timeout)")
    p.add_argument("--lookback", type=float, default=24.0, metavar="HOURS",
                   help="runs that crashed longer ago are left alone, default 24")
    p.add_argument("--tag", default=TAG, help=f"sweep only flow runs with this tag, default {TAG}")
    p.add_argument("--once", action="store_true", help="one sweep, then exit (an unreachable API: exit status 1)")
    p.set_defaults(func=cmd_recover)


def cmd_recover(args: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from posttrain import redact
    from posttrain.cli import UsageError
    from posttrain.pipeline.deployments.recovery import RecoveryConfig, run

    flags = {"retries": "--retries", "pending_timeout_s": "--pending-timeout", "every_s": "--every",
             "lookback_h": "--lookback", "tag": "--tag", "heartbeat_timeout_s": "--heartbeat-timeout"}
    try:
        cfg = RecoveryConfig(retries=args.retries, pending_timeout_s=args.pending_timeout, every_s=args.every,
                             lookback_h=args.lookback, tag=args.tag, heartbeat_timeout_s=args.heartbeat_timeout)
    except ValidationError as e:
        err = e.errors()[0]
        if not err["loc"]:  # a rule across fields: its message names them
            raise UsageError(err["msg"].removeprefix("Value error, ").replace("every_s", "--every").replace(
                "heartbeat_timeout_s", "--heartbeat-timeout")) from None
        raise UsageError(f"{flags.get(str(err['loc'][0]), err['loc'][0])} {err['input']}: "
                         f"{err['msg'].removeprefix('Value error, ')}") from None
    silent = (f"no heartbeat for {cfg.heartbeat_timeout_s:.0f} s is Crashed" if cfg.heartbeat_timeout_s
              else "no heartbeat rule")
    print(f"posttrain recover: runs tagged {cfg.tag}; at most {cfg.retries} retries per run; Pending for "
          f"{cfg.pending_timeout_s:.0f} s is Crashed; {silent}; a sweep every {cfg.every_s:.0f} s", flush=True)
    try:
        # what it prints quotes the API's errors and the runs' crash messages: scrubbed of credentials
        asyncio.run(run(cfg, once=args.once, say=lambda line: print(redact.scrub(line), flush=True)))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # noqa: BLE001 - only --once gets here: the API could not be swept
        print(redact.scrub(f"posttrain recover: the sweep failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"))
        return 1
    return 0
