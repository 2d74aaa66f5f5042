"""The soak's independent checker, alone on a soak folder (issue 35; docs/reliability.md, "The checker").

    .venv/bin/python bench/soak_check.py SOAK_DIR [--offline] [--only snapshots,replies] [--json OUT]

Reads SOAK_DIR (what ``bench/soak.py --out SOAK_DIR`` wrote: soak.json and the .jsonl records),
the object store soak.json names (credentials from the environment variables it names), the run
folders, and, unless ``--offline``, the live system: the Prefect API, the gateways' /health and
/metrics, the process table and squeue. Prints one row per check (items checked, violations,
skipped) and then every violation; exits 1 when there is any violation, 0 otherwise (2: bad
arguments). ``--offline`` reports what it could not look at as skipped, never as passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.testing.soak.check import CHECKS, run_checks, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="soak_check.py",
        description="Check a chaos soak's folder and what the system stored: snapshots, promotion histories, "
                    "replies, GRPO rounds, run states and leftovers. Exit status 1 on any violation.")
    parser.add_argument("soak_dir", type=Path, help="the folder bench/soak.py wrote (--out)")
    parser.add_argument("--offline", action="store_true",
                        help="do not ask the running system (Prefect, gateways, processes, Slurm); those items are "
                             "reported as skipped")
    parser.add_argument("--only", default="", help=f"comma-separated checks to run (of {', '.join(CHECKS)})")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    if not (args.soak_dir / "soak.json").is_file():
        parser.error(f"{args.soak_dir}: no soak.json (not a soak folder)")
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown} (the checks: {', '.join(CHECKS)})")
    results = run_checks(args.soak_dir, live=not args.offline, only=only or None)
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
