"""Checkpoint chain codec: full snapshots and XOR+zstd delta snapshots.

Plain Python with numpy, zstandard and xxhash; no Prefect and no torch import.
The wire format is ``docs/delta-format.md`` (CoreWeave and slime flavours).
"""

from posttrain.chain.errors import (
    ChainError,
    ChecksumMismatch,
    FormatError,
    LayoutMismatch,
    OutputExists,
    WrongBase,
)

__all__ = [
    "ChainError",
    "ChecksumMismatch",
    "FormatError",
    "LayoutMismatch",
    "OutputExists",
    "WrongBase",
]
