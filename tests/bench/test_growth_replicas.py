"""bench/growth.py replicas at its smallest size: what does not depend on the machine's speed.

A delta hot-load into 1 and 2 reference servers (a 4 MiB checkpoint, a SeaweedFS of the bench's
own, each server behind a counting proxy): every replica ends serving the delta, read back from a
completion's stamp, and each reads from the store the delta's bytes once plus a small constant
(its index and checksums), the same for every replica and every count; nothing else, not the full
snapshot. The full table (1-8 servers, 256 MiB) is the benchmark's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import growth_replicas  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.slow]  # starts servers of its own
MiB = 1 << 20


def test_each_replica_reads_the_delta_once_and_every_replica_serves_it() -> None:
    rows = growth_replicas.measure_replicas([1, 2], mib=4)

    assert [r["replicas"] for r in rows] == [1, 2]
    delta = rows[0]["delta_bytes"]
    assert 0 < delta < 0.5 * 4 * MiB  # a delta, not a second full snapshot
    per_replica = {b for r in rows for b in r["per_replica_bytes"]}
    assert len(per_replica) == 1, rows  # the same bytes whichever replica, however many there are
    (each,) = per_replica
    assert delta <= each <= delta + growth_replicas.OVERHEAD_BYTES, (each, delta)
    for row in rows:
        assert row["delta_bytes"] == delta
        assert len(row["per_replica_bytes"]) == row["replicas"]
        assert row["store_bytes"] == each * row["replicas"]  # no replica reads for another: N reads, no more
        assert row["all_serve_delta"] and not row["fell_back"], row
    assert growth_replicas.verdicts(rows)[0][-1] == "met"
