"""Durable file-system writes shared by the engines: one way to replace a file atomically."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder (a folder's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", **open_args: Any) -> Iterator[IO[Any]]:
    """Write a file that readers see whole or not at all, and that survives a crash once written.

    Yields a file opened on a temporary name beside ``path``; on a clean exit it is flushed,
    fsynced and renamed over ``path``, and the folder is fsynced. On an exception the temporary
    file is removed and ``path`` is left as it was. Parent folders are created.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    if mode == "w":
        open_args.setdefault("encoding", "utf-8")
    try:
        with open(tmp, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Replace ``path`` with ``data`` atomically and durably (see ``atomic_open``)."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(path)
