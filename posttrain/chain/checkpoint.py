"""Hugging Face checkpoint directories, read lazily: headers up front, tensor bytes on demand.

Tensor bytes are mapped one bounded window at a time (populated up front, unmapped as soon as
the window is consumed), so a pass over a checkpoint copies nothing out of the page cache and
its resident memory stays at a few windows whatever the model size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from posttrain.chain.errors import ChecksumMismatch, FormatError
from posttrain.chain.manifest import MANIFEST_NAME, load_manifest
from posttrain.chain.safetensors_io import TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# Fixed, so that streamed output never depends on a setting.
CHUNK_BYTES = 8 << 20


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise FormatError(f"{path}: {what} not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: {what} is not a JSON object")
    return obj


@dataclass
class Checkpoint:
    """A safetensors checkpoint directory: one ``model.safetensors`` or shards with an index."""

    path: Path
    tensors: dict[str, TensorInfo]
    shard_files: list[str]
    index_metadata: dict = field(default_factory=dict)
    shard_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    # tensor -> xxh3-128 its bytes must have (posttrain.checksums.json); checked as they are read
    expected: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a checkpoint; with posttrain's checksums file, its files and headers are checked first."""
        path = Path(path)
        if not path.is_dir():
            raise FormatError(f"{path}: not a checkpoint directory")
        manifest = load_manifest(path)
        if manifest is not None:
            manifest.check_all()
        ckpt = cls._open(path)
        if manifest is not None:
            if (path / INDEX_NAME).exists() and INDEX_NAME not in manifest.files:
                raise ChecksumMismatch(f"{manifest.label}: file {INDEX_NAME} is not in its {MANIFEST_NAME}")
            for name, info in ckpt.tensors.items():
                entry = manifest.files.get(info.path.name)
                if entry is None:
                    raise ChecksumMismatch(f"{manifest.label}: file {info.path.name} is not in its {MANIFEST_NAME}")
                if "tensors" in entry:  # else the file was checked whole above
                    if name not in entry["tensors"]:
                        raise manifest.fail(info.path.name, f"tensor {name!r} is not in {MANIFEST_NAME}")
                    ckpt.expected[name] = entry["tensors"][name]
        return ckpt

    @classmethod
    def _open(cls, path: Path) -> Checkpoint:
        index_path = path / INDEX_NAME
        if index_path.exists():
            return cls._open_indexed(path, index_path)
        single = path / SINGLE_NAME
        if single.exists():
            header = read_header(single)
            return cls(path, dict(header.tensors), [SINGLE_NAME], {}, {SINGLE_NAME: header.metadata})
        raise FormatError(f"{path}: no {SINGLE_NAME} and no {INDEX_NAME}")

    @classmethod
    def _open_indexed(cls, path: Path, index_path: Path) -> Checkpoint:
        index = read_json(index_path, "index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise FormatError(f"{index_path}: weight_map must map tensor names to file names")
        metadata = index.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise FormatError(f"{index_path}: metadata must be an object")
        files = sorted(set(weight_map.values()))
        tensors: dict[str, TensorInfo] = {}
        shard_meta: dict[str, dict[str, str]] = {}
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise FormatError(f"{index_path}: shard name {name!r} is not a file of the directory")
            shard = path / name
            if not shard.is_file():
                raise FormatError(f"{index_path}: names shard {name!r}, which does not exist")
            header = read_header(shard)
            shard_meta[name] = header.metadata
            for tname, info in header.tensors.items():
                if weight_map.get(tname) != name:
                    raise FormatError(f"{shard}: holds tensor {tname!r}, which the index does not map to it")
                tensors[tname] = info
        for tname, fname in weight_map.items():
            if tname not in tensors:
                raise FormatError(f"{index_path}: maps tensor {tname!r} to {fname!r}, which does not hold it")
        ordered = {k: tensors[k] for k in sorted(tensors)}
        return cls(path, ordered, files, metadata, shard_meta)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {name: (t.dtype, t.shape) for name, t in self.tensors.items()}

    def config_bytes(self) -> bytes | None:
        cfg = self.path / CONFIG_NAME
        return cfg.read_bytes() if cfg.is_file() else None


def check_tensor_digest(info: TensorInfo, got: str, want: str | None) -> None:
    """Refuse a tensor whose bytes, as just read, differ from its folder's checksums file."""
    if want is not None and got != want:
        raise ChecksumMismatch(
            f"snapshot {info.path.parent.name}: file {info.path.name} is corrupted (tensor {info.name!r} has "
            f"xxh3-128 {got}, {MANIFEST_NAME} records {want}); {info.path}"
        )


def layout_changes(
    new: dict[str, tuple[str, tuple[int, ...]]], base: dict[str, tuple[str, tuple[int, ...]]]
) -> list[str]:
    """Human-readable differences of tensor names, shapes and dtypes; empty when none."""
    out = []
    for name in sorted(set(new) | set(base)):
        if name not in base:
            out.append(f"tensor {name!r} is new (not in the base)")
        elif name not in new:
            out.append(f"tensor {name!r} of the base is missing")
        elif new[name] != base[name]:
            (nd, ns), (bd, bs) = new[name], base[name]
            out.append(f"tensor {name!r} changed from {bd}{list(bs)} to {nd}{list(ns)}")
    return out


class ChunkReader:
    """Reads byte ranges of files in chunks of at most ``chunk`` bytes into a buffer of its own,
    one descriptor per file. Callers must not keep a yielded array past the next iteration: the
    buffer is read into again then."""

    def __init__(self, chunk: int = CHUNK_BYTES):
        self.chunk = chunk
        self._fds: dict[Path, int] = {}
        self._buf: np.ndarray | None = None

    def fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def chunks(self, info: TensorInfo) -> Iterator[np.ndarray]:
        fd = self.fd(info.path)
        if self._buf is None:
            self._buf = np.empty(self.chunk, dtype=np.uint8)
        view = memoryview(self._buf)
        for start in range(0, info.nbytes, self.chunk):
            n = min(self.chunk, info.nbytes - start)
            got = 0
            while got < n:
                k = os.preadv(fd, [view[got:n]], info.offset + start + got)
                if k == 0:
                    raise FormatError(f"{info.path}: cannot read tensor {info.name!r} (the file ends early)")
                got += k
            yield self._buf[:n]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
