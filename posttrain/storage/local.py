"""``LocalStore``: the ``Store`` interface on a folder (the embedded default)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from posttrain.errors import naming
from posttrain.fsutil import atomic_path, fsync_path
from posttrain.storage.base import PathLike, Store
from posttrain.storage.errors import InvalidKey, InvalidURI, NotFound, PreconditionFailed, StorageError
from posttrain.storage.keys import check_key, check_prefix

META_DIR = ".posttrain-store"  # lock file and temporary files; never listed


def etag_of(data: bytes) -> str:
    """The ETag a LocalStore gives content: its quoted MD5, like S3's for a single PUT."""
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


class LocalStore(Store):
    """Objects are files under ``root``; writes are atomic (temporary file, fsync, rename).

    Not ``fsutil.atomic_open``: a temporary file beside its key would be listed as an object, so
    temporary files live in the hidden ``META_DIR``, and the rename happens under the lock, after
    a conditional write's check.

    Renames, deletes and conditional writes run under one ``flock`` lock file, so
    conditional writes are safe between threads and processes on this machine.
    """

    def __init__(self, root: PathLike) -> None:
        self.root = Path(root).absolute()
        self._meta = self.root / META_DIR
        self._tmp = self._meta / "tmp"
        if self.root.exists() and not self.root.is_dir():
            raise InvalidURI(f"store {self.root}: is not a folder")
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"store {self.root}: cannot create {e.filename or self._tmp}: {e.strerror}") from None

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    # ------------------------------------------------------------------ writes
    def put_file(self, local_path: PathLike, key: str) -> None:
        dest = self._path(key)
        tmp = self._tmp_path()
        try:
            with naming(dest):  # a full disk names the key's file, not the temporary one
                shutil.copyfile(local_path, tmp)  # a copy: the source may change later
                fsync_path(tmp)
            with self._lock():
                self._publish(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(
        self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        if if_none_match and if_match is not None:
            raise ValueError("put_bytes: give if_none_match or if_match, not both")
        dest = self._path(key)
        data = bytes(data)
        tmp = self._tmp_path()
        try:
            with naming(dest):
                tmp.write_bytes(data)
                fsync_path(tmp)
            with self._lock():
                if if_none_match and dest.is_file():
                    raise PreconditionFailed(f"{self._name(key)}: exists (if_none_match)")
                if if_match is not None:
                    try:
                        current = etag_of(dest.read_bytes())
                    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                        raise PreconditionFailed(f"{self._name(key)}: does not exist (if_match)") from None
                    if current.strip('"') != if_match.strip('"'):
                        raise PreconditionFailed(f"{self._name(key)}: ETag changed (if_match {if_match})")
                self._publish(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return etag_of(data)

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]  # check every key before deleting any
        with self._lock():
            for path in paths:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    path.unlink()
                self._prune(path.parent)

    # ------------------------------------------------------------------ reads
    def get_file(self, key: str, local_path: PathLike) -> None:
        src = self._path(key)
        with atomic_path(local_path, durable=False) as tmp:  # a copy that can be fetched again
            try:
                shutil.copyfile(src, tmp)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise self._not_found(key) from None

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        try:
            data = self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self._not_found(key) from None
        return data, etag_of(data)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            raise self._not_found(key) from None
        if not stat.S_ISREG(st.st_mode):
            raise self._not_found(key)
        return st.st_size

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        # walk only the deepest folder the prefix names, then filter by string prefix
        folder, _, _ = prefix.rpartition("/")
        base = self.root / folder if folder else self.root
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            if Path(dirpath) == self.root:
                dirnames[:] = [d for d in dirnames if d != META_DIR]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    found.append(key)
        yield from sorted(found)

    # ------------------------------------------------------------------ helpers
    def _path(self, key: str) -> Path:
        check_key(key)
        if key.split("/", 1)[0] == META_DIR:
            raise InvalidKey(f"invalid key {key!r}: {META_DIR}/ is reserved by LocalStore")
        return self.root / key

    def _name(self, key: str) -> str:
        return f"{self.uri}/{key}"

    def _not_found(self, key: str) -> NotFound:
        return NotFound(f"{self._name(key)}: no such key")

    def _tmp_path(self) -> Path:
        return self._tmp / uuid.uuid4().hex

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        with open(self._meta / "lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _publish(self, tmp: Path, dest: Path) -> None:
        """Rename into place (caller holds the lock) and make the rename durable."""
        if dest.is_dir():
            raise InvalidKey(f"{self.uri}/{dest.relative_to(self.root).as_posix()}: is a prefix of other keys")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            name = dest.relative_to(self.root).as_posix()
            raise InvalidKey(f"{self.uri}/{name}: a leading part of the key is an object") from None
        os.replace(tmp, dest)
        fsync_path(dest.parent)

    def _prune(self, folder: Path) -> None:
        """Remove folders left empty by deletes, up to the root."""
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent
