"""Writing the codec's output files: whole buffers at an offset, into preallocated space."""

from __future__ import annotations

import os

import numpy as np


def pwrite_all(fd: int, data: memoryview | np.ndarray, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    mv = memoryview(data).cast("B")
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv = mv[n:]
        offset += n


def preallocate(fd: int, size: int) -> None:
    # Writing into a sparse (ftruncated) file costs ext4 an allocation per write: ~15x slower.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.ftruncate(fd, size)
