"""Key rules shared by every store: relative, '/'-separated, no empty, '.' or '..' segments."""

from __future__ import annotations

from posttrain.storage.errors import InvalidKey

MAX_KEY_BYTES = 1024  # S3's limit, for the key including the store's prefix


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise InvalidKey naming it."""
    if not isinstance(key, str):
        raise InvalidKey(f"invalid key {key!r}: not a string")
    problem = _problem(key)
    if problem:
        raise InvalidKey(f"invalid key {key!r}: {problem}")
    return key


def check_prefix(prefix: str) -> str:
    """Return a listing prefix: '' or a key, optionally ending in '/'."""
    if not isinstance(prefix, str):
        raise InvalidKey(f"invalid prefix {prefix!r}: not a string")
    if prefix == "":
        return prefix
    problem = _problem(prefix[:-1] if prefix.endswith("/") else prefix)
    if problem:
        raise InvalidKey(f"invalid prefix {prefix!r}: {problem}")
    return prefix


def join(prefix: str, key: str) -> str:
    """``prefix/key``, or ``key`` when there is no prefix."""
    return f"{prefix}/{key}" if prefix else key


def _problem(key: str) -> str | None:
    if key == "":
        return "empty"
    if key.startswith("/"):
        return "leading '/' (keys are relative to the store)"
    if "\x00" in key:
        return "NUL character"
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        return f"longer than {MAX_KEY_BYTES} bytes"
    for segment in key.split("/"):
        if segment == "":
            return "empty segment ('//' or trailing '/')"
        if segment in (".", ".."):
            return f"'{segment}' segment"
    return None
