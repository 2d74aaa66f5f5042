"""The reference server's hot-load rebuild path, alone, in a process of its own (for bench/growth_size.py).

    growth_size_rebuild.py s3://bucket/prefix ENDPOINT WORK full|delta

``full``: nothing held, the store's full snapshot is fetched and rebuilt into WORK/full. ``delta``:
the full version held (WORK/full), the delta fetched and applied onto it into WORK/delta. The same
calls as the hot-load service's load (plan, fetch, view, reconstruct without fsync, a full
snapshot's files moved from the cache); the engine's model load after it is not the chain's cost.
Prints one JSON line: fetch and apply seconds and the bytes fetched.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path


def main(uri: str, endpoint: str, work: Path, kind: str) -> None:
    from posttrain.chain.checkpoint import INDEX_NAME
    from posttrain.chain.fetch import SnapshotSource
    from posttrain.chain.ops import reconstruct
    from posttrain.storage import open_store

    store = open_store(uri, endpoint_url=endpoint, region="us-east-1", addressing_style="path")
    source = SnapshotSource(store, "", work / "cache")
    identities = sorted({k.split("/", 1)[0] for k in store.list("") if k.endswith("/" + INDEX_NAME)})
    kinds = {i: source.describe(i)[0] for i in identities}
    full = next(i for i, k in kinds.items() if k == "full")
    target = full if kind == "full" else next(i for i, k in kinds.items() if k == "delta")
    held, held_dir = (None, None) if kind == "full" else (full, work / "full")
    out = work / kind
    t0 = time.perf_counter()
    plan = source.plan(target, held)
    fetched = sum(p.stat().st_size for i in plan.snapshots for p in source.fetch(i).iterdir())
    t1 = time.perf_counter()
    view = source.view(plan, held, held_dir, work / f"view-{kind}")
    reconstruct(view, target, out, held_dir=held_dir if plan.start == "held" else None, durable=False, take_full=True)
    t2 = time.perf_counter()
    shutil.rmtree(view)
    source.forget(list(plan.snapshots))
    print(json.dumps({"fetch": t1 - t0, "apply": t2 - t1, "fetched_bytes": fetched, "target": target}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4])
