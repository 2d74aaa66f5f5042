"""Error types every package may share; this module imports nothing of posttrain.

``TransientError`` marks a failure that may go away when the same call is made again later
(a service that did not answer, throttled, or did not finish in time). The pipeline's retry
rule (``posttrain.pipeline.tasks.retry``) retries a task on these by type, never by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


class TransientError(Exception):
    """A failure worth retrying later: the service did not answer, throttled us, or was too slow."""


def describe_os_error(e: OSError) -> str:
    """One line for a failed file operation: the path(s) and the reason, without the errno noise."""
    reason = e.strerror or str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


@contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """Give an ``OSError`` raised inside (a full disk: ``write`` names no file) ``path`` as its file."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


def describe_validation_error(e: object, names: dict[str, str] | None = None) -> str:
    """One line for a pydantic ``ValidationError``: the first field at fault and why, and how many more.

    ``names`` maps a field's dotted location to what the user typed (a command-line option)."""
    errors = e.errors(include_url=False, include_input=False, include_context=False)  # type: ignore[attr-defined]
    if not errors:
        return str(e)
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    shown = (names or {}).get(loc, loc or getattr(e, "title", "value"))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    msg = first["msg"].removeprefix("Value error, ")
    return f"{shown}: {msg}{more}"


__all__ = ["TransientError", "describe_os_error", "describe_validation_error", "naming"]
