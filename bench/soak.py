"""The chaos soak (issue 35): the whole system on this machine, left alone under faults.

    bench/soak.py --minutes 3 --seed 1 [--backend local] [--out DIR] [--services own|shared] [--dry-run]

It starts a PostgreSQL and a Prefect server of its own on free ports (``--services own``, the
default; ``shared`` uses the ones at $PREFECT_API_URL) and uses SeaweedFS at $POSTTRAIN_S3_ENDPOINT
(set -a; . /tmp/posttrain-services.env, or scripts/test.sh's environment). It starts what is its
own: a fault proxy in front of SeaweedFS, a tmpfs for the runs' folders, three ``posttrain serve``
gateways (production, staging, rollouts), blocks, a work pool and deployments named
soak-<seed>-..., a process worker and ``posttrain recover`` beside it, each under a restart loop.
Then compressed nights (a nightly run promoting to production and a GRPO run with max_staleness 1
each night, gc at each night's end), an operator rolling back and promoting at seeded times, a
client sending greedy completions to production all along, and the faults of a seeded schedule
(printed at the start; --dry-run prints it and exits). At the end it stops starting runs, waits
for every run to end, stops what it started, writes the soak folder that ``bench/soak_check.py``
reads (the contract: posttrain/testing/soak/__init__.py), runs that checker on it while the
system still runs (its table in check.txt; ``--no-check`` skips it), then stops its own services.
Exit status 0 when the soak ran to its end and the checker found no violation, 4 when it found
some, 1 when the soak could not be set up, 2 for bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
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
                   help="where training runs: local processes (default), or jobs on the test Slurm cluster "
                   "(scripts/services/start-slurm.sh; one node a job, the soak's folder as shared storage)")
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
    p.add_argument("--services", choices=["own", "shared"], default="own",
                   help="own (default): a PostgreSQL and a Prefect server of the soak's own, on free ports, started "
                   "and stopped by it, so that its restart faults meet no one else; shared: the ones at "
                   "$PREFECT_API_URL (the test command's), restarted under whatever else uses them")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not run the checker (bench/soak_check.py) at the end; by default it runs on the folder "
                   "while the system still runs, and a violation makes the exit status 4")
    p.add_argument("--no-faults", action="store_true",
                   help="inject nothing (the same nights, operator and client): the fault-free baseline that "
                   "goodput under faults is compared with")
    p.add_argument("--dry-run", action="store_true", help="print the schedule (faults, operator, nights) and exit")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.night_s <= 10 or args.drain_s < 0 or args.spool_mib < 16:
        p.error("--minutes > 0, --night-s > 10, --drain-s >= 0, --spool-mib >= 16")
    if args.backend == "slurm" and not args.dry_run:
        import shutil
        import subprocess

        ok = shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0
        if not ok:
            p.error("--backend slurm: no Slurm cluster answers sinfo (start it: scripts/services/start-slurm.sh)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    the_plan = plan(args.seed, args.minutes, args.night_s)
    if args.no_faults:  # the baseline of goodput: the same nights and operator, nothing injected
        the_plan = dataclasses.replace(the_plan, faults=[])
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
