"""bench/growth.py size at its smallest sizes: what does not depend on the machine's speed.

The codec's memory does not follow the checkpoint's size (it streams a tensor's pieces), and a
delta hot-load fetches the delta only. The full table (0.25-8 GiB) is the benchmark's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import growth_size  # noqa: E402

pytestmark = pytest.mark.slow


def test_codec_memory_is_flat_in_the_size_and_a_delta_hot_load_fetches_the_delta_only(
        seaweedfs_endpoint: str, tmp_path: Path) -> None:
    from growth_common import ensure_bucket
    from publish_hotload import boto_client

    ensure_bucket(boto_client(seaweedfs_endpoint), growth_size.BUCKET)  # the replicas test may make it too
    rows = {(r["gib"], r["stage"]): r for gib, endpoint in ((0.03, None), (0.12, seaweedfs_endpoint))
            for r in growth_size.measure_size(gib, tmp_path, endpoint, keep_pair=False)}
    for stage in ("encode delta", "apply delta"):
        small, large = rows[(0.03, stage)]["rss_mib"], rows[(0.12, stage)]["rss_mib"]
        assert large <= growth_size.CODEC_RSS_MIB, (stage, large)
        # 4x the tensors, the same memory: one tensor's pieces at a time (within allocator noise)
        assert large <= small + 24, (stage, small, large)
    delta, full = rows[(0.12, "hot-load delta")], rows[(0.12, "hot-load full")]
    assert full["stored_bytes"] >= 0.9 * full["raw_bytes"]  # bf16 noise barely compresses: the full is fetched
    assert delta["stored_bytes"] <= 0.5 * full["stored_bytes"], (delta, full)
    # nothing left behind but the pairs' folder (removed: keep_pair=False)
    assert not any(tmp_path.glob("work-*"))
