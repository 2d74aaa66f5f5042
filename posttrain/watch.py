"""Watch a training output folder and yield each complete checkpoint once, in step order.

A ``checkpoint-<step>`` folder counts only when it is completely written: its weights
(``model.safetensors``, or every shard named in ``model.safetensors.index.json``) have valid
safetensors headers whose offsets match the file sizes, and ``config.json`` and
``trainer_state.json`` parse. The Hugging Face Trainer writes ``trainer_state.json`` last, so a
folder that passes was finished. Anything else (``tmp-checkpoint-*``, missing files, truncated
shards, transformers' ``checkpoint-is-incomplete.txt`` sentinel) is ignored until it is complete.

The watch keeps a cursor file (the last step handed out, written atomically), so a restarted
watch continues after it. Delivery is at least once: the cursor moves past a checkpoint when
the consumer asks for the next one, so a consumer that dies while handling a checkpoint sees it
again. Checkpoints deleted by ``save_total_limit`` rotation, or left incomplete once a later one
is complete, are reported as skipped and never block later ones (a checkpoint written and
deleted between two scans is never seen, so it is not reported).

Pure Python: no torch import.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.chain.errors import FormatError
from posttrain.chain.safetensors_io import read_header

log = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
TRAINER_STATE_FILE = "trainer_state.json"
INCOMPLETE_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint marker


class IncompleteCheckpoint(Exception):
    """The folder is not (yet) a complete checkpoint; the message says what is missing."""


class CheckpointInfo(BaseModel):
    """A complete checkpoint folder."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="Training step, from the folder name checkpoint-<step>.")
    path: Path = Field(description="The checkpoint folder.")
    weight_files: list[str] = Field(description="Safetensors files holding the weights, in index order.")
    weight_bytes: int = Field(ge=0, description="Total size of the weight files in bytes.")
    policy_version: int | None = Field(
        None, description="Policy version recorded in trainer_state.json, when the trainer records one."
    )


class SkippedCheckpoint(BaseModel):
    """A checkpoint that will not be yielded: deleted, or still incomplete when a later one was complete."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="Training step of the skipped folder.")
    path: Path = Field(description="The folder, which may no longer exist.")
    reason: str = Field(description="Why it was skipped.")


class WatchCursor(BaseModel):
    """The persistent position of a watch."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str = Field(description="The watched output folder; a cursor belongs to one folder.")
    last_step: int | None = Field(None, description="Step of the last checkpoint handled, None before the first.")
    skipped: list[int] = Field(default_factory=list, description="Steps reported as skipped so far.")
    updated: datetime = Field(description="When the cursor was last written (UTC).")


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe a complete checkpoint folder or raise IncompleteCheckpoint saying what is missing."""
    path = Path(path)
    match = CHECKPOINT_NAME.match(path.name)
    if match is None:
        raise IncompleteCheckpoint(f"{path}: not named checkpoint-<step>")
    try:
        if (path / INCOMPLETE_SENTINEL).exists():
            raise IncompleteCheckpoint(f"{path}: {INCOMPLETE_SENTINEL} is present")
        _read_json_object(path / CONFIG_FILE)
        state = _read_json_object(path / TRAINER_STATE_FILE)
        weight_files = _weight_files(path)
        weight_bytes = 0
        for name in weight_files:
            try:
                weight_bytes += read_header(path / name).file_size
            except FormatError as e:
                raise IncompleteCheckpoint(str(e)) from None
    except OSError as e:  # e.g. the folder was rotated away while we read it
        raise IncompleteCheckpoint(f"{path}: {e.strerror or e}") from None
    version = state.get("policy_version")
    return CheckpointInfo(
        step=int(match.group(1)),
        path=path,
        weight_files=weight_files,
        weight_bytes=weight_bytes,
        policy_version=version if isinstance(version, int) else None,
    )


def checkpoint_dirs(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, folder) of every ``checkpoint-<step>`` entry, complete or not, by step."""
    output_dir = Path(output_dir)
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = CHECKPOINT_NAME.match(name)
        if match and (output_dir / name).is_dir():
            found.append((int(match.group(1)), output_dir / name))
    return sorted(found)


def complete_checkpoints(output_dir: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every complete checkpoint in ``output_dir``, by step."""
    return [info for _, path in checkpoint_dirs(output_dir) if (info := _try_inspect(path)) is not None]


def last_complete_checkpoint(
    output_dir: str | os.PathLike[str], *, required_files: Iterable[str] = ()
) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step that also holds ``required_files``, if any."""
    required = tuple(required_files)
    for _, path in reversed(checkpoint_dirs(output_dir)):
        info = _try_inspect(path)
        if info is not None and all((path / name).is_file() for name in required):
            return info
    return None


def watch_checkpoints(
    output_dir: str | os.PathLike[str],
    *,
    cursor_path: str | os.PathLike[str],
    is_job_done: Callable[[], bool],
    poll_interval: float = 5.0,
    on_skip: Callable[[SkippedCheckpoint], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[CheckpointInfo]:
    """Yield complete checkpoints of ``output_dir`` in step order as they appear.

    Ends once ``is_job_done()`` returned True and every checkpoint present at that point has been
    yielded or skipped. Skips go to ``on_skip`` (and the log). The cursor at ``cursor_path``
    records the last step handled; see the module docstring for the delivery guarantee.
    """
    output_dir = Path(output_dir)
    cursor_path = Path(cursor_path)
    cursor = load_cursor(cursor_path, output_dir)
    pending: dict[int, Path] = {}  # seen, after the cursor, not yet yielded or skipped

    def skip(step: int, reason: str) -> None:
        path = pending.pop(step)
        if not path.exists():
            reason = "deleted before it was handed out (save_total_limit rotation?)"
        skipped = SkippedCheckpoint(step=step, path=path, reason=reason)
        log.warning("skipping checkpoint %s: %s", path, skipped.reason)
        cursor.skipped.append(step)
        _save_cursor(cursor_path, cursor)
        if on_skip is not None:
            on_skip(skipped)

    while True:
        done = is_job_done()  # read before scanning, so whatever it waited for is on disk
        last = -1 if cursor.last_step is None else cursor.last_step
        for step, path in checkpoint_dirs(output_dir):
            if step > last:
                pending[step] = path
        while (ready := _next_ready(pending)) is not None:
            info, superseded = ready
            for step in superseded:
                skip(step, f"still incomplete while checkpoint-{info.step} is complete")
            yield info
            pending.pop(info.step)
            cursor.last_step = info.step
            _save_cursor(cursor_path, cursor)
        if done:
            for step in sorted(pending):
                skip(step, "still incomplete when the job ended")
            return
        sleep(poll_interval)


def load_cursor(cursor_path: str | os.PathLike[str], output_dir: str | os.PathLike[str]) -> WatchCursor:
    """The cursor stored at ``cursor_path``, or a fresh one; it must belong to ``output_dir``."""
    cursor_path = Path(cursor_path)
    folder = str(Path(output_dir).absolute())
    try:
        cursor = WatchCursor.model_validate_json(cursor_path.read_bytes())
    except FileNotFoundError:
        return WatchCursor(output_dir=folder, updated=datetime.now(UTC))
    except ValidationError as e:
        raise ValueError(f"{cursor_path}: not a valid watch cursor: {e}") from None
    if cursor.output_dir != folder:
        raise ValueError(f"{cursor_path}: cursor belongs to {cursor.output_dir}, not {folder}")
    return cursor


def _next_ready(pending: dict[int, Path]) -> tuple[CheckpointInfo, list[int]] | None:
    """The lowest complete pending checkpoint and the lower pending steps it supersedes."""
    steps = sorted(pending)
    for i, step in enumerate(steps):
        info = _try_inspect(pending[step])
        if info is None:
            continue
        # A lower folder may have been finished between its inspection and this one: look again.
        for j, lower in enumerate(steps[:i]):
            lower_info = _try_inspect(pending[lower])
            if lower_info is not None:
                return lower_info, steps[:j]
        return info, steps[:i]
    return None


def _try_inspect(path: Path) -> CheckpointInfo | None:
    try:
        return inspect_checkpoint(path)
    except IncompleteCheckpoint:
        return None


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise IncompleteCheckpoint(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise IncompleteCheckpoint(f"{path}: not complete JSON") from None
    if not isinstance(obj, dict):
        raise IncompleteCheckpoint(f"{path}: not a JSON object")
    return obj


def _weight_files(path: Path) -> list[str]:
    if not (path / WEIGHTS_INDEX_FILE).exists():
        if not (path / WEIGHTS_FILE).exists():
            raise IncompleteCheckpoint(f"{path}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")
        return [WEIGHTS_FILE]
    index = _read_json_object(path / WEIGHTS_INDEX_FILE)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise IncompleteCheckpoint(f"{path / WEIGHTS_INDEX_FILE}: no weight_map")
    files = list(dict.fromkeys(weight_map.values()))
    for name in files:
        if not isinstance(name, str) or Path(name).name != name:
            raise IncompleteCheckpoint(f"{path / WEIGHTS_INDEX_FILE}: bad shard name {name!r}")
    return files


def _save_cursor(cursor_path: Path, cursor: WatchCursor) -> None:
    cursor.updated = datetime.now(UTC)
    cursor_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cursor_path.with_name(f".{cursor_path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(cursor.model_dump_json(indent=2).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, cursor_path)
