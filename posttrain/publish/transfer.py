"""The publisher's store side: upload a snapshot folder (index last), retire old chains."""

from __future__ import annotations

from pathlib import Path

import xxhash

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.publish.ledger import Ledger, PublishedFile
from posttrain.storage import Store
from posttrain.testing.crashpoints import crashpoint


def upload_snapshot(store: Store, local: Path, identity: str) -> tuple[dict[str, PublishedFile], int]:
    """Upload ``local`` as ``<identity>/``: shards first, the index (the commit marker) last; files
    already in the store with the same size are not uploaded again. Its files and the bytes sent."""
    names = sorted(p.name for p in local.iterdir() if p.is_file() and p.name != INDEX_NAME)
    shards = [n for n in names if n.endswith(".safetensors")]
    order = shards + [n for n in names if n not in shards] + [INDEX_NAME]
    files: dict[str, PublishedFile] = {}
    uploaded = 0
    for name in order:
        path = local / name
        size = path.stat().st_size
        key = f"{identity}/{name}"
        if name == INDEX_NAME:
            crashpoint("before_index")
        if not (store.exists(key) and store.size(key) == size):
            store.put_file(path, key)
            uploaded += size
        files[name] = PublishedFile(size=size, xxh3_128=file_digest(path))
        crashpoint("after_index" if name == INDEX_NAME else "after_file")
    return files, uploaded


def retire_old_chains(store: Store, ledger: Ledger) -> None:
    """Delete chains older than the previous one (opt-in): never the newest two chains. Step claims
    stay, so a retired step handed in again is still recognised."""
    entries = ledger.entries()
    fulls = [e for e in entries if e.kind == "full"]
    if len(fulls) < 3:
        return
    cutoff = fulls[-2]  # the previous chain stays for consumers still reading it
    for e in entries:
        if (e.step, e.published_at) < (cutoff.step, cutoff.published_at):
            # the index goes first: a snapshot without its index does not exist
            store.delete([f"{e.identity}/{INDEX_NAME}"])
            store.delete([f"{e.identity}/{n}" for n in e.files if n != INDEX_NAME])
            ledger.delete(e.identity)
            crashpoint("during_retention")


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()
