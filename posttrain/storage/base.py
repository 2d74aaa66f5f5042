"""The ``Store`` interface: a flat namespace of keys holding bytes."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


class Store(ABC):
    """Object storage used by the snapshot publisher and the inference servers.

    Keys are relative to the store's root or prefix (see ``posttrain.storage.keys``).
    ETags are opaque strings: pass back exactly what ``put_bytes``/``get_bytes`` returned.
    Every method is safe to call from several threads.
    """

    @property
    @abstractmethod
    def uri(self) -> str:
        """Where the store lives (``s3://bucket/prefix`` or ``file:///path``), without secrets."""

    @abstractmethod
    def put_file(self, local_path: PathLike, key: str) -> None:
        """Upload a local file (in parallel parts when large). Readers never see a partial object."""

    @abstractmethod
    def get_file(self, key: str, local_path: PathLike) -> None:
        """Download to ``local_path`` through a temporary file renamed at the end.

        Missing parent folders are created. Raises NotFound.
        """

    @abstractmethod
    def put_bytes(
        self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        """Write ``data`` and return its ETag.

        ``if_none_match``: only if the key does not exist. ``if_match``: only if the key's
        current ETag is this one. Otherwise raise PreconditionFailed. A write whose response
        was lost and that the client retried can also end in PreconditionFailed although it
        took effect: compare the current content when that matters.
        """

    @abstractmethod
    def get_bytes(self, key: str) -> tuple[bytes, str]:
        """Return ``(data, etag)``. Raises NotFound."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the key exists."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield the keys starting with ``prefix`` (a plain string prefix), in sorted order."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete the keys; missing ones are ignored."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes. Raises NotFound."""

    def close(self) -> None:
        """Release connections. The store must not be used afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
