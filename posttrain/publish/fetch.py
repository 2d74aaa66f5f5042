"""Download the snapshots a version needs from a store, then reconstruct it locally."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.errors import FormatError
from posttrain.chain.folder import SLIME_DIR_RE
from posttrain.chain.format import parse_slime_version, slime_dir
from posttrain.chain.ops import Reconstructed, commit_dir, reconstruct, staging_dir
from posttrain.storage import NotFound, Store


def _index(store: Store, identity: str) -> dict:
    try:
        data, _ = store.get_bytes(f"{identity}/{INDEX_NAME}")
    except NotFound:
        raise FormatError(f"{store.uri}: snapshot {identity!r} has no index (not published)") from None
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise FormatError(f"{store.uri}: {identity}/{INDEX_NAME} is not valid JSON ({e})") from None


def chain_path(store: Store, identity: str, *, held: str | None = None) -> list[str]:
    """Snapshot folders from the full snapshot (or the one after ``held``) to ``identity``."""
    names: list[str] = []
    current = identity
    while True:
        if current in names:
            raise FormatError(f"{store.uri}: base links loop at {current}")
        meta = _index(store, current).get("metadata") or {}
        names.append(current)
        if "delta_encoding" not in meta:
            break
        base = str(meta.get("base_version"))
        if held is not None and base == held:
            break
        if SLIME_DIR_RE.match(current):
            n = parse_slime_version(base)
            if n == 0:
                break  # slime's boot weights
            current = slime_dir(n)
        else:
            current = base
    return list(reversed(names))


def fetch_snapshot(store: Store, identity: str, cache_dir: Path) -> Path:
    """Download one snapshot folder (index last, so a cached folder with an index is complete)."""
    local = cache_dir / identity
    if (local / INDEX_NAME).exists():
        return local
    index = _index(store, identity)
    files = sorted(set(index.get("weight_map", {}).values()))
    if "delta_encoding" not in (index.get("metadata") or {}) and store.exists(f"{identity}/config.json"):
        files.append("config.json")
    with staging_dir(local) as tmp:
        for name in files:
            store.get_file(f"{identity}/{name}", tmp / name)
        (tmp / INDEX_NAME).write_text(json.dumps(index))
        commit_dir(tmp, local)
    return local


def reconstruct_from_store(
    store: Store,
    identity: str,
    out_dir: Path,
    *,
    cache_dir: Path,
    held_dir: Path | None = None,
    held: str | None = None,
    boot_dir: Path | None = None,
) -> Reconstructed:
    """Fetch what ``identity`` needs into ``cache_dir`` and rebuild it at ``out_dir``."""
    for name in chain_path(store, identity, held=held):
        fetch_snapshot(store, name, cache_dir)
    return reconstruct(cache_dir, identity, out_dir, held_dir=held_dir, boot_dir=boot_dir)
