"""Benchmark: how cost grows with model size, rounds, shards, store size and replicas.

One command, a subcommand per dimension; each prints its table (with the machine and load above
it), writes its raw rows to bench/.data/growth/<dimension>.json and a PNG plot into docs/growth/
(plots need matplotlib: ``pip install -e '.[bench]'``). The tables and plots are in
docs/benchmarks.md, "How cost grows".

    .venv/bin/python bench/growth.py size      [--gib 0.25 1 4 8]
    .venv/bin/python bench/growth.py rounds    [--rounds 200]
    .venv/bin/python bench/growth.py shards    [--shards 8 32 64 128 256]
    .venv/bin/python bench/growth.py store     [--snapshots 10 100 1000]
    .venv/bin/python bench/growth.py replicas  [--replicas 1 2 4 8]

Each dimension lives in bench/growth_<dimension>.py with ``add_args(parser)`` and ``main(args)``;
the measuring functions there are what tests/bench/ calls at the smallest size.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DIMENSIONS = {
    "size": "model size: encode, apply, publish, full and delta hot-load at 0.25-8 GiB",
    "rounds": "a long GRPO run: per-round wall, RSS, database rows, artifact and run-folder bytes",
    "shards": "one round at 8-256 shards on PostgreSQL against the no-Prefect floor",
    "store": "gc --dry-run, history, chain inspect, champion lookup, rollback against the store's size",
    "replicas": "a delta hot-load into 1-8 reference servers: wall time and bytes read from the store",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="dimension", required=True)
    argv = sys.argv[1:] if argv is None else argv
    # only the chosen dimension's module is imported (each starts what it needs); all of them for --help
    chosen = [argv[0]] if argv and argv[0] in DIMENSIONS else list(DIMENSIONS)
    for name in chosen:
        module = importlib.import_module(f"growth_{name}")
        module.add_args(sub.add_parser(name, help=DIMENSIONS[name], description=DIMENSIONS[name]))
    args = ap.parse_args(argv)
    importlib.import_module(f"growth_{args.dimension}").main(args)


if __name__ == "__main__":
    main()
