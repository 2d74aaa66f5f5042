"""``open_store``: a Store from a URI (``s3://bucket/prefix``, ``file:///path`` or a path)."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote, urlsplit

from posttrain.errors import validation_problems
from posttrain.storage.base import Store
from posttrain.storage.errors import InvalidURI
from posttrain.storage.local import LocalStore

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_store(uri: str | os.PathLike[str], **options: Any) -> Store:
    """Open the store at ``uri``.

    ``s3://bucket/prefix`` gives an S3Store; ``options`` are S3StoreConfig fields
    (endpoint_url, region, part_size, ...). ``file:///path`` or a plain path gives a
    LocalStore (no options).
    """
    text = os.fspath(uri)
    if not isinstance(text, str) or text == "":
        raise InvalidURI(f"store URI {text!r}: empty")
    match = _SCHEME.match(text)
    scheme = match.group(1).lower() if match else ""
    if scheme == "s3":
        return _open_s3(text, options)
    if options:
        raise InvalidURI(f"store URI {_redact(text)!r}: options {sorted(options)} apply to s3:// stores only")
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise InvalidURI(f"store URI {_redact(text)!r}: file URIs name no host (use file:///path)")
        if not parts.path:
            raise InvalidURI(f"store URI {_redact(text)!r}: no path")
        return LocalStore(unquote(parts.path))
    if scheme:
        raise InvalidURI(f"store URI {_redact(text)!r}: unsupported scheme {scheme!r} (use s3://, file:// or a path)")
    return LocalStore(text)


def _open_s3(text: str, options: dict[str, Any]) -> Store:
    from pydantic import ValidationError

    from posttrain.storage.s3 import S3Store
    from posttrain.storage.s3config import S3StoreConfig

    shown = _redact(text)
    parts = urlsplit(text)
    if "@" in parts.netloc:
        raise InvalidURI(f"store URI {shown!r}: put no credentials in the URI (use options or the environment)")
    if parts.query or parts.fragment:
        raise InvalidURI(f"store URI {shown!r}: no '?' or '#' parts allowed")
    if not parts.netloc:
        raise InvalidURI(f"store URI {shown!r}: no bucket (expected s3://bucket/prefix)")
    for name in ("bucket", "prefix"):
        if name in options:
            raise InvalidURI(f"store URI {shown!r}: {name} comes from the URI, not from options")
    try:
        config = S3StoreConfig(bucket=parts.netloc, prefix=unquote(parts.path), **options)
    except ValidationError as e:
        problems = "; ".join(validation_problems(e))
        raise InvalidURI(f"store URI {shown!r}: {problems}") from None
    return S3Store(config)


def _redact(text: str) -> str:
    """The URI with any user:password@ part hidden."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1***@", text)
