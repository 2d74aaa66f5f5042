"""What a checkpoint is, for the publisher: its training step and the digest of its weights.

``checkpoint_content`` is ``chain.format.content_digest`` of the checkpoint's tensors, the digest
the encoder records for the version it writes, so a checkpoint handed in again can be compared
with the one published for its step without downloading anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from posttrain.chain.checkpoint import Checkpoint, ChunkReader
from posttrain.chain.errors import ChainError
from posttrain.chain.format import content_digest
from posttrain.chain.ops import CHECKPOINT_STEP_RE


class NoStep(ChainError):
    """A checkpoint folder whose step can be read neither from its name nor from trainer_state.json."""


def step_of(path: Path) -> int:
    """The step of a checkpoint folder: ``checkpoint-<N>`` in its name, else ``global_step`` of its
    ``trainer_state.json``; ``NoStep`` otherwise (never a silent 0)."""
    m = CHECKPOINT_STEP_RE.search(path.name)
    if m:
        return int(m.group(1))
    state = path / "trainer_state.json"
    if state.is_file():
        try:
            step = json.loads(state.read_text()).get("global_step")
        except (ValueError, AttributeError):
            raise NoStep(f"{state}: not a JSON object with global_step") from None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
        raise NoStep(f"{state}: global_step is {step!r}, not a step number")
    raise NoStep(f"{path}: no step in the folder's name (checkpoint-<N>) and no trainer_state.json; "
                 "give the step (--step)")


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
