"""Spooling checkpoints on local disk by hard links, so rotation cannot delete a queued one."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from posttrain.chain.errors import FormatError
from posttrain.chain.ops import commit_dir, staging_dir

SPOOL_RE = re.compile(r"^step-(\d{8})$")
_COPY_INSTEAD = {errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


def spool_name(step: int) -> str:
    return f"step-{step:08d}"


def spooled_step(path: Path) -> int | None:
    m = SPOOL_RE.fullmatch(path.name)
    return int(m.group(1)) if m else None


def spool_checkpoint(src: Path, dest: Path) -> Path:
    """Link (or, across file systems, copy) a checkpoint's weights and json files into ``dest``."""
    if dest.exists():
        return dest  # spooled before a crash: the same checkpoint
    files = sorted(p for p in src.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".json")))
    if not any(p.suffix == ".safetensors" for p in files):
        raise FormatError(f"{src}: no .safetensors files to publish")
    with staging_dir(dest) as tmp:
        for p in files:
            try:
                os.link(p, tmp / p.name)
            except OSError as e:
                if e.errno not in _COPY_INSTEAD:
                    raise
                shutil.copy2(p, tmp / p.name)
        commit_dir(tmp, dest)
    return dest


def queued(spool_dir: Path) -> list[tuple[int, Path]]:
    """Spooled checkpoints waiting to be published, in step order."""
    if not spool_dir.exists():
        return []
    items = [(spooled_step(p), p) for p in spool_dir.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in items if s is not None)


def promote_base(work_dir: Path, step: int, spooled: Path) -> None:
    """The published checkpoint becomes the base of the next delta; older bases go."""
    base = work_dir / f"base-{spool_name(step)}"
    if spooled.exists():
        if base.exists():
            shutil.rmtree(spooled)
        else:
            os.rename(spooled, base)
    for p in work_dir.iterdir():
        if p.name.startswith("base-") and p != base:
            shutil.rmtree(p)
