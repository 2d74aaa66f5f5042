"""Watch a training output folder and yield each complete checkpoint once, in step order.

What counts as complete is ``posttrain.trainer.checkpoints``'s rule. The watch keeps a cursor
file (the last step handed out, written atomically), so a restarted watch continues after it.
Delivery is at least once: the cursor moves past a checkpoint when the consumer asks for the
next one, so a consumer that dies while handling a checkpoint sees it again. Checkpoints deleted
by ``save_total_limit`` rotation, or left incomplete once a later one is complete, are reported
as skipped and never block later ones (a checkpoint written and deleted between two scans is
never seen, so it is not reported).

Pure Python: no torch import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.errors import describe_os_error, describe_validation_error
from posttrain.fsutil import atomic_write
from posttrain.trainer.checkpoints import CheckpointInfo, checkpoint_dirs, try_inspect

log = logging.getLogger(__name__)


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
        data = cursor_path.read_bytes()
    except FileNotFoundError:
        return WatchCursor(output_dir=folder, updated=datetime.now(UTC))
    except OSError as e:
        raise ValueError(f"{cursor_path}: cannot read the watch cursor: {describe_os_error(e)}") from None
    if not data.strip():
        raise ValueError(f"{cursor_path}: the watch cursor file is empty (remove it to start from the first "
                         "checkpoint)")
    try:
        cursor = WatchCursor.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"{cursor_path}: not a valid watch cursor: {describe_validation_error(e)}") from None
    if cursor.output_dir != folder:
        raise ValueError(f"{cursor_path}: cursor belongs to {cursor.output_dir}, not {folder}")
    return cursor


def _next_ready(pending: dict[int, Path]) -> tuple[CheckpointInfo, list[int]] | None:
    """The lowest complete pending checkpoint and the lower pending steps it supersedes."""
    steps = sorted(pending)
    for i, step in enumerate(steps):
        info = try_inspect(pending[step])
        if info is None:
            continue
        # A lower folder may have been finished between its inspection and this one: look again.
        for j, lower in enumerate(steps[:i]):
            lower_info = try_inspect(pending[lower])
            if lower_info is not None:
                return lower_info, steps[:j]
        return info, steps[:i]
    return None


def _save_cursor(cursor_path: Path, cursor: WatchCursor) -> None:
    cursor.updated = datetime.now(UTC)
    atomic_write(cursor_path, cursor.model_dump_json(indent=2) + "\n")
