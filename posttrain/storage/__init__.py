"""Object storage for snapshots: one ``Store`` interface over a folder or S3.

``open_store("s3://bucket/prefix", endpoint_url=...)`` or ``open_store("/path")``.
Importing this package is cheap: pydantic loads with the S3 classes, boto3 on the
first S3 request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.storage.base import Store
from posttrain.storage.errors import InvalidKey, InvalidURI, NotFound, PreconditionFailed, StorageError
from posttrain.storage.local import LocalStore
from posttrain.storage.uri import open_store

if TYPE_CHECKING:
    from posttrain.storage.s3 import S3Store
    from posttrain.storage.s3config import S3StoreConfig

__all__ = [
    "InvalidKey",
    "InvalidURI",
    "LocalStore",
    "NotFound",
    "PreconditionFailed",
    "S3Store",
    "S3StoreConfig",
    "StorageError",
    "Store",
    "open_store",
]


def __getattr__(name: str) -> Any:
    if name == "S3Store":
        from posttrain.storage.s3 import S3Store

        return S3Store
    if name == "S3StoreConfig":
        from posttrain.storage.s3config import S3StoreConfig

        return S3StoreConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
