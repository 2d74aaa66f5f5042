"""``PrefixedStore``: a view of a store under a sub-prefix (a deployment's ``path_prefix``).

Keys given to the view are joined to the prefix; keys it lists come back relative to it. The
view does not own the store: closing it leaves the store open.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from posttrain.storage.base import PathLike, Store
from posttrain.storage.keys import check_key, check_prefix, join


class PrefixedStore(Store):
    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = check_key(prefix.strip("/")) if prefix.strip("/") else ""

    @property
    def uri(self) -> str:
        return join(self.store.uri.rstrip("/"), self.prefix) if self.prefix else self.store.uri

    def _k(self, key: str) -> str:
        return join(self.prefix, check_key(key))

    def put_file(self, local_path: PathLike, key: str) -> None:
        self.store.put_file(local_path, self._k(key))

    def get_file(self, key: str, local_path: PathLike) -> None:
        self.store.get_file(self._k(key), local_path)

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        return self.store.put_bytes(self._k(key), data, if_none_match=if_none_match, if_match=if_match)

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        return self.store.get_bytes(self._k(key))

    def exists(self, key: str) -> bool:
        return self.store.exists(self._k(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        if not self.prefix:
            yield from self.store.list(prefix)
            return
        root = self.prefix + "/"
        for key in self.store.list(root + prefix):
            yield key[len(root):]

    def delete(self, keys: Iterable[str]) -> None:
        self.store.delete([self._k(k) for k in keys])

    def size(self, key: str) -> int:
        return self.store.size(self._k(key))

    def close(self) -> None:
        """Nothing: the underlying store is the caller's to close."""


def under(store: Store, prefix: str) -> Store:
    """``store`` itself when ``prefix`` is empty, else a ``PrefixedStore`` view of it."""
    return PrefixedStore(store, prefix) if prefix.strip("/") else store
