"""Which ``checkpoint-<step>`` folders of a training output folder are complete.

A folder counts only when it is completely written: its weights (``model.safetensors``, or every
shard named in ``model.safetensors.index.json``; for a LoRA checkpoint ``adapter_model.safetensors``)
have valid safetensors headers whose offsets match the file sizes, and ``config.json`` (LoRA:
``adapter_config.json``) and ``trainer_state.json`` parse. The Hugging Face
Trainer writes ``trainer_state.json`` last, so a folder that passes was finished. Anything else
(a ``.tmp-checkpoint-*`` staging folder, missing files, truncated shards, transformers'
``checkpoint-is-incomplete.txt`` sentinel) is incomplete.

The trainer resumes from these; ``posttrain.runs.watch`` hands them out as they appear. No torch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from posttrain.chain.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from posttrain.chain.errors import FormatError
from posttrain.chain.safetensors_io import read_header
from posttrain.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
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
    adapter: bool = Field(False, description="A LoRA checkpoint: a peft adapter and a reference to its base.")


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe a complete checkpoint folder or raise IncompleteCheckpoint saying what is missing."""
    path = Path(path)
    match = CHECKPOINT_NAME.fullmatch(path.name)
    if match is None:
        raise IncompleteCheckpoint(f"{path}: not named checkpoint-<step>")
    try:
        if (path / INCOMPLETE_SENTINEL).exists():
            raise IncompleteCheckpoint(f"{path}: {INCOMPLETE_SENTINEL} is present")
        adapter = (path / ADAPTER_CONFIG).exists()
        _read_json_object(path / (ADAPTER_CONFIG if adapter else CONFIG_NAME))
        state = _read_json_object(path / TRAINER_STATE_FILE)
        weight_files = [ADAPTER_WEIGHTS] if adapter else _weight_files(path)
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
        adapter=adapter,
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
        match = CHECKPOINT_NAME.fullmatch(name)
        if match and (output_dir / name).is_dir():
            found.append((int(match.group(1)), output_dir / name))
    return sorted(found)


def complete_checkpoints(output_dir: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every complete checkpoint in ``output_dir``, by step."""
    return [info for _, path in checkpoint_dirs(output_dir) if (info := try_inspect(path)) is not None]


def last_complete_checkpoint(
    output_dir: str | os.PathLike[str], *, required_files: Iterable[str] = ()
) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step that also holds ``required_files``, if any."""
    required = tuple(required_files)
    for _, path in reversed(checkpoint_dirs(output_dir)):
        info = try_inspect(path)
        if info is not None and all((path / name).is_file() for name in required):
            return info
    return None


def try_inspect(path: Path) -> CheckpointInfo | None:
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
    if not (path / INDEX_NAME).exists():
        if not (path / SINGLE_NAME).exists():
            raise IncompleteCheckpoint(f"{path}: neither {SINGLE_NAME} nor {INDEX_NAME}")
        return [SINGLE_NAME]
    index = _read_json_object(path / INDEX_NAME)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise IncompleteCheckpoint(f"{path / INDEX_NAME}: no weight_map")
    files = list(dict.fromkeys(weight_map.values()))
    for name in files:
        if not isinstance(name, str) or Path(name).name != name:
            raise IncompleteCheckpoint(f"{path / INDEX_NAME}: bad shard name {name!r}")
    return files
