"""The chaos soak (issue 35): the whole system on this machine, left alone under faults.

    bench/soak.py --minutes 3 --seed 1 [--backend local] [--out DIR] [--dry-run]

It uses the services the test command starts (Prefect on PostgreSQL at $PREFECT_API_URL, SeaweedFS at
$POSTTRAIN_S3_ENDPOINT; set -a; . /tmp/posttrain-services.env or scripts/test.sh's environment) and
starts what is its own: a fault proxy in front of SeaweedFS, a tmpfs for the runs' folders, three
``posttrain serve`` gateways (production, staging, rollouts), blocks, a work pool and deployments named
soak-<seed>-..., and a process worker, each under a restart loop. Then compressed nights (a nightly
run promoting to production and a GRPO run with max_staleness 1 each night, gc at each night's end),
an operator rolling back and promoting at seeded times, a client sending greedy completions to
production all along, and the faults of a seeded schedule (printed at the start; --dry-run prints
it and exits). At the end it stops starting runs, waits for every run to end, stops what it started
(it leaves the services running, starting again any a fault left stopped) and writes the soak
folder that ``bench/soak_check.py`` reads (the contract: posttrain/testing/soak/__init__.py).
Exit status 0 when the soak ran to its end (violations are the checker's to find), 1 when it could
not be set up, 2 for bad options.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.testing.soak import ACCESS_KEY_ENV, SECRET_KEY_ENV, TOKEN_ENV  # noqa: E402
from posttrain.testing.soak.schedule import plan  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--minutes", type=float, required=True,
                   help="how long runs are started and faults injected; the drain after it is extra")
    p.add_argument("--seed", type=int, required=True, help="seeds the fault schedule and the operator's times")
    p.add_argument("--backend", choices=["local", "slurm"], default="local",
                   help="where training runs: local processes (default) or the test Slurm cluster (not yet: "
                   "refused)")
    p.add_argument("--out", type=Path, help="the soak folder (default /tmp/posttrain-soak/seed-<S>-<UTC time>)")
    p.add_argument("--night-s", type=float, default=90.0,
                   help="seconds of one compressed night: a nightly and a GRPO run start at its beginning, gc "
                   "runs at its end (default 90)")
    p.add_argument("--drain-s", type=float, default=900.0,
                   help="after --minutes: how long to wait for every started run to end (default 900)")
    p.add_argument("--crashed-settle-s", type=float, default=120.0,
                   help="the drain counts a Crashed run as ended once it has stayed Crashed this long (posttrain "
                   "recover, beside the worker, retries one within 5 s until its bound) (default 120)")
    p.add_argument("--spool-mib", type=int, default=256,
                   help="size of the tmpfs holding the runs' folders, which spool_full fills (default 256)")
    p.add_argument("--client-interval-s", type=float, default=0.5,
                   help="seconds between the client's completions requests to production (default 0.5)")
    p.add_argument("--dry-run", action="store_true", help="print the schedule (faults, operator, nights) and exit")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.night_s <= 10 or args.drain_s < 0 or args.spool_mib < 16:
        p.error("--minutes > 0, --night-s > 10, --drain-s >= 0, --spool-mib >= 16")
    if args.backend == "slurm":
        p.error("--backend slurm is not implemented yet: the soak trains with local processes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    the_plan = plan(args.seed, args.minutes, args.night_s)
    print(the_plan.describe(), flush=True)
    if args.dry_run:
        for fault in the_plan.faults:
            print(fault.line())
        return 0
    from posttrain.testing.soak.run import Soak

    out = args.out or Path("/tmp/posttrain-soak") / f"seed-{args.seed}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(ACCESS_KEY_ENV, "test")
    os.environ.setdefault(SECRET_KEY_ENV, "test")
    os.environ.pop(TOKEN_ENV, None)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    # SIGTERM (a test's timeout, a person's kill) and SIGINT, even where a shell left it ignored: the
    # soak stops what it started before it exits
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupted)
    return Soak(args, the_plan, out).run()


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
