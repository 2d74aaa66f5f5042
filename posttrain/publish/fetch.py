"""Reconstruct a published version from a store: fetch the snapshots it needs, then apply them."""

from __future__ import annotations

from pathlib import Path

from posttrain.chain.ops import Reconstructed, reconstruct
from posttrain.inference.snapshot_fetch import SnapshotSource
from posttrain.storage import Store


def reconstruct_from_store(store: Store, identity: str, out_dir: Path, *, cache_dir: Path) -> Reconstructed:
    """Download (into ``cache_dir``) the full snapshot and deltas ``identity`` needs; rebuild it at ``out_dir``."""
    source = SnapshotSource(store, "", cache_dir)
    for name in source.plan(identity, held=None).snapshots:
        source.fetch(name)
    return reconstruct(cache_dir, identity, out_dir)
