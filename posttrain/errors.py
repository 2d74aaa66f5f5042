"""Error types every package may share; this module imports nothing of posttrain.

``TransientError`` marks a failure that may go away when the same call is made again later
(a service that did not answer, throttled, or did not finish in time). The pipeline's retry
rule (``posttrain.pipeline.tasks.retry``) retries a task on these by type, never by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class TransientError(Exception):
    """A failure worth retrying later: the service did not answer, throttled us, or was too slow."""


def describe_os_error(e: OSError) -> str:
    """One line for a failed file operation: the path(s) and the reason, without the errno noise."""
    reason = e.strerror or str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


def file_in_the_way(folder: Path) -> Path | None:
    """The file at ``folder`` or at one of its parents, which keeps it from being a folder (mkdir would
    say only "Not a directory" or "File exists"), or None."""
    for p in (folder, *folder.parents):
        if p.exists():
            return p if not p.is_dir() else None
    return None


@contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """Give an ``OSError`` raised inside (a full disk: ``write`` names no file) ``path`` as its file."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


def _problems(e: object, names: dict[str, str] | None, untitled: str) -> list[str]:
    errors = e.errors(include_url=False, include_input=False, include_context=False)  # type: ignore[attr-defined]
    lines = []
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"])
        shown = (names or {}).get(loc, loc or untitled)
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        lines.append(f"{shown}: {msg}" if shown else msg)
    return lines


def validation_problems(e: object, names: dict[str, str] | None = None) -> list[str]:
    """One line per problem of a pydantic ``ValidationError``: ``field: why``, the field's dotted
    location (or what ``names`` maps it to: a command-line option), without pydantic's "Value error, "
    before the message. A model-level check has no location: its message is the line (it names the
    fields it compares)."""
    return _problems(e, names, "")


def describe_validation_error(e: object, names: dict[str, str] | None = None) -> str:
    """One line for a pydantic ``ValidationError``: the first problem (``validation_problems``; a
    model-level one after the model's name) and how many more."""
    problems = _problems(e, names, getattr(e, "title", "value"))
    if not problems:
        return str(e)
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{problems[0]}{more}"


__all__ = ["TransientError", "describe_os_error", "describe_validation_error", "file_in_the_way", "naming", "validation_problems"]
