"""Durable file-system writes shared by the engines."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder (a folder's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
