"""Checks an engine runs before it lets another process see a folder, and the gate that keeps
requests and version switches apart."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from posttrain.chain.checkpoint import CONFIG_NAME, Checkpoint, ChunkReader

Layout = dict[str, tuple[str, tuple[int, ...]]]


def folder_layout(folder: Path) -> Layout:
    """Tensor names, dtypes and shapes of a checkpoint folder, from its safetensors headers only
    (a truncated shard or an index naming a missing file raises ``FormatError`` naming it)."""
    return Checkpoint.open(folder).layout()


class LayoutMismatch(ValueError):
    """A version whose tensors (names, dtypes, shapes) do not fit the served model."""


def check_layout(folder: Path, expected: Layout) -> None:
    """Raise ``ValueError`` naming the tensors of ``folder`` that are missing, extra, or of
    another dtype or shape than the served model's: an engine must never see such a folder
    (vLLM keeps a missing tensor's old value, and breaks on a wrong shape)."""
    got = folder_layout(folder)
    problems = []
    for name in sorted(set(got) | set(expected)):
        if name not in got:
            problems.append(f"tensor {name!r} is missing")
        elif name not in expected:
            problems.append(f"tensor {name!r} is not in the served model")
        elif got[name] != expected[name]:
            (dtype, shape), (want_dtype, want_shape) = got[name], expected[name]
            problems.append(f"tensor {name!r} is {dtype}{list(shape)}, the served model's is "
                            f"{want_dtype}{list(want_shape)}")
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise LayoutMismatch(f"{folder}: does not fit the served model: {'; '.join(problems[:5])}{more}")


def same_weights(a: Path, b: Path) -> bool:
    """Whether two checkpoint folders hold the same tensors, byte for byte (however sharded)."""
    ca, cb = Checkpoint.open(a), Checkpoint.open(b)
    if ca.layout() != cb.layout():
        return False
    with ChunkReader() as ra, ChunkReader() as rb:
        for name, info in ca.tensors.items():
            da, db = xxhash.xxh3_128(), xxhash.xxh3_128()
            for chunk in ra.chunks(info):
                da.update(chunk)
            for chunk in rb.chunks(cb.tensors[name]):
                db.update(chunk)
            if da.digest() != db.digest():
                return False
    return True


def ties_embeddings(folder: Path) -> bool:
    """Whether the model's config ties the LM head to the input embeddings."""
    try:
        config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def model_depth(folder: Path) -> int | None:
    """The model's number of layers (``num_hidden_layers`` of its config), None where it does not say."""
    try:
        config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = text.get("num_hidden_layers", config.get("num_hidden_layers"))
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


class Gate:
    """Many requests at once, or one version switch alone: a switch waits for the requests in
    flight and holds new ones back, so every answer is stamped with the version that made it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._writer = True  # new readers wait from here on
            self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
