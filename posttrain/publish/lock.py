"""One publisher (or one ``posttrain serve``) per work folder: an ``flock`` on ``<work_dir>/.lock``.

Two publishers on one work folder would spool, stage and promote the same folders under each
other. The lock is taken when a ``Publisher`` is made and released when it is closed (or its
process ends, since the kernel drops an flock with its descriptor). By default a second
publisher fails at once, naming the folder and the holder's pid (written into the lock file);
``timeout`` > 0 waits that many seconds for the holder to finish first.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from posttrain.chain.errors import ChainError

LOCK_NAME = ".lock"


class WorkDirBusy(ChainError):
    """Another publisher (or server) holds the work folder."""


class WorkDirLock:
    def __init__(self, work_dir: Path, *, timeout: float = 0.0, poll: float = 0.1, owner: str = "publisher"):
        """``owner``: what holds such a lock, for the error a second one gets."""
        self.path = Path(work_dir) / LOCK_NAME
        self._fd: int | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + max(timeout, 0.0)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        waited = f" after waiting {timeout:g}s" if timeout > 0 else ""
                        raise WorkDirBusy(f"work dir {work_dir} is in use by another {owner} "
                                          f"({self._holder(fd)}){waited}") from None
                    time.sleep(poll)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @staticmethod
    def _holder(fd: int) -> str:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        return f"pid {text}" if text.isdigit() else "pid unknown"

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # drops the flock; the file stays, its stale pid is overwritten by the next holder
