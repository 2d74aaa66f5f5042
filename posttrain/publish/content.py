"""What a checkpoint is, for the publisher: its training step and the digest of its weights.

``checkpoint_content`` is ``chain.format.content_digest`` of the checkpoint's tensors, the digest
the encoder records for the version it writes, so a checkpoint handed in again can be compared
with the one published for its step without downloading anything.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from posttrain.chain.checkpoint import Checkpoint, ChunkReader
from posttrain.chain.format import content_digest


def checkpoint_content(path: Path) -> str:
    """Content digest of the checkpoint's weights: names, dtypes, shapes and xxh3-128 of the bytes."""
    ckpt = Checkpoint.open(path)
    entries = {}
    with ChunkReader() as reader:
        for name, info in ckpt.tensors.items():
            h = xxhash.xxh3_128()
            for chunk in reader.chunks(info):
                h.update(chunk)
            entries[name] = (info.dtype, info.shape, h.hexdigest())
    return content_digest(entries)


def head_content(path: Path, digests: dict[str, str]) -> str:
    """Content digest from the chain head's tensor digests and the checkpoint's layout (no reading)."""
    layout = Checkpoint.open(path).layout()
    return content_digest({n: (dtype, shape, digests[n]) for n, (dtype, shape) in layout.items()})


def saved_at(path: Path) -> float | None:
    """When a checkpoint folder was saved: the newest modification time of its files (the trainer
    writes a checkpoint whole, then moves it into place); None for an empty or missing folder."""
    try:
        times = [p.stat().st_mtime for p in Path(path).rglob("*") if p.is_file()]
    except OSError:
        return None
    return max(times) if times else None
