"""Durable file-system writes shared by the engines: one way to replace a file atomically,
and one way to move a folder built under a temporary name into place; and one way to read a
file another process appends to (``written_lines``)."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


# Longest file name (bytes) most file systems take. Temporary names add a few characters to the
# final name, so a name near this limit (a 255-character snapshot identity) is shortened in them.
NAME_MAX = 255


def fit_name(name: str, room: int) -> str:
    """``name``, or when it takes more than ``room`` bytes its start and a digest of it that do:
    distinct names stay distinct, and the same name always gives the same result."""
    raw = os.fsencode(name)
    if len(raw) <= room:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return os.fsdecode(raw[: room - len(digest) - 1]) + "~" + digest


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder (a folder's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[Path]:
    """A temporary name beside ``path`` for a writer that needs a file name (a copy, a download).

    On a clean exit the file the caller wrote there is renamed over ``path``; with ``durable``
    it is fsynced first and the folder after. On an exception the temporary file is removed and
    ``path`` is left as it was. Parent folders are created. ``durable=False`` suits copies that
    can be fetched again (downloads into a cache), where an fsync would only slow large files.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = f".tmp-{os.getpid()}-{secrets.token_hex(3)}"
    tmp = path.with_name(f".{fit_name(path.name, NAME_MAX - 1 - len(suffix))}{suffix}")
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


@contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", **open_args: Any) -> Iterator[IO[Any]]:
    """Write a file that readers see whole or not at all, and that survives a crash once written.

    Yields a file opened on a temporary name beside ``path``; on a clean exit it is flushed,
    fsynced and renamed over ``path``, and the folder is fsynced. On an exception the temporary
    file is removed and ``path`` is left as it was. Parent folders are created.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    if mode == "w":
        open_args.setdefault("encoding", "utf-8")
    with atomic_path(path) as tmp, open(tmp, mode, **open_args) as f:
        yield f


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Replace ``path`` with ``data`` atomically and durably (see ``atomic_open``)."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(path)


@contextmanager
def staging_dir(final: str | os.PathLike[str], *, clear_leftovers: bool = False) -> Iterator[Path]:
    """A new empty hidden folder beside ``final`` to build it in; removed on exit unless it was
    moved into place (``publish_dir``). ``clear_leftovers`` first removes the staging folders
    of earlier, killed attempts at ``final``: only for a target that one writer builds at a time.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    stem = f".tmp-{fit_name(final.name, NAME_MAX - 14)}"  # and "-" and 8 hex digits: 14 more in all
    if clear_leftovers:
        for leftover in final.parent.glob(f"{glob.escape(stem)}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = final.parent / f"{stem}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def publish_dir(tmp: str | os.PathLike[str], final: str | os.PathLike[str], *, sync_files: bool = False) -> Path:
    """Rename the folder ``tmp`` to ``final`` durably, never overwriting: ``FileExistsError``
    naming ``final`` when it exists already (``tmp`` is then left to the caller).

    The folder is fsynced before the rename and its parent after; ``sync_files`` also fsyncs
    everything in it first, for writers (e.g. ``save_pretrained``) that do not sync their own.
    """
    tmp, final = Path(tmp), Path(final)
    if sync_files:
        for path in sorted(tmp.rglob("*")):
            if not path.is_symlink():
                fsync_path(path)
    fsync_path(tmp)
    try:
        os.rename(tmp, final)  # fails on an existing non-empty folder: never overwrites
    except OSError:
        if final.exists():
            raise FileExistsError(f"{final} already exists; nothing was overwritten") from None
        raise
    fsync_path(final.parent)
    return final


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


def write_behind(fd: int, offset: int, length: int) -> None:
    """Start writing back a range just written (Linux; a no-op elsewhere), without waiting for it.

    The disk then writes while the codec computes, and the final fsync finds little left to do.
    Durability still comes from that fsync only.
    """
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; errors surface at fsync


def written_lines(path: str | os.PathLike[str]) -> list[tuple[int, bytes]]:
    """The lines of a file another process appends to (one line per write), each ending in its
    newline, as (line number from 1, bytes without the newline): what the writer finished.

    A reader can catch the writer mid-line, and an NFS client can see the file's new size before
    its bytes, which it reads as NULs. So trailing NUL bytes, and a last line without its newline,
    are not written yet: left out, never an error. A bad line before them is the caller's to
    refuse (naming the file and the line number). FileNotFoundError when there is no file."""
    data = Path(path).read_bytes().rstrip(b"\0")
    complete = data[: data.rfind(b"\n") + 1]  # empty when no line has its newline yet
    return list(enumerate(complete.splitlines(), start=1))
