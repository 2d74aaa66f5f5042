"""Loading the blocks a run names, inside tasks (blocks are looked up, never passed around)."""

from __future__ import annotations

from prefect.blocks.core import Block


def load_block(ref: str, what: str) -> Block:
    """``ref`` is ``<block-type-slug>/<name>``; the error names the run setting at fault."""
    if "/" not in ref:
        raise ValueError(f"{what}: {ref!r} is not <block-type-slug>/<name>")
    import posttrain.pipeline.blocks  # noqa: F401 - registers posttrain's block classes for Block.load

    try:
        return Block.load(ref)
    except Exception as e:  # noqa: BLE001 - whatever Block.load raises, name the setting
        raise ValueError(f"{what}: cannot load block {ref!r} ({type(e).__name__}: {e})") from None
