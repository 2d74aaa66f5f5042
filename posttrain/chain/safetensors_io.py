"""Streaming safetensors: validated header parsing and a writer that never holds a whole tensor.

The ``safetensors`` package reads and writes whole tensors (and has no numpy bfloat16), so the
codec reads headers itself and copies tensor bytes in bounded chunks. The writer lays a file
out exactly as the Rust ``safetensors`` serializer does (tensors sorted by descending dtype
alignment, then name; compact JSON; header padded with spaces to 8 bytes), which a test pins
against ``safetensors.numpy.save_file`` and ``safetensors.torch.save_file``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from posttrain.chain.errors import FormatError

# Rust safetensors `Dtype` variants in declaration order (their `Ord`), with item sizes.
# The serializer sorts tensors by this rank, descending.
DTYPE_ORDER: tuple[tuple[str, int], ...] = (
    ("BOOL", 1),
    ("U8", 1),
    ("I8", 1),
    ("F8_E5M2", 1),
    ("F8_E4M3", 1),
    ("F8_E8M0", 1),
    ("I16", 2),
    ("U16", 2),
    ("F16", 2),
    ("BF16", 2),
    ("I32", 4),
    ("U32", 4),
    ("F32", 4),
    ("F64", 8),
    ("I64", 8),
    ("U64", 8),
)
DTYPE_RANK = {name: rank for rank, (name, _) in enumerate(DTYPE_ORDER)}
ITEMSIZE = dict(DTYPE_ORDER)

# The Rust reader refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: where its bytes live, absolutely, in ``path``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]  # in file order
    data_start: int
    file_size: int


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and validate a safetensors header; raise FormatError naming the file otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: truncated, {size} bytes is shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise FormatError(
                    f"{path}: header length {n} is absurdly large (limit {MAX_HEADER_BYTES} bytes)"
                )
            if 8 + n > size:
                raise FormatError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    try:
        obj = json.loads(raw.decode("utf-8").rstrip(" "))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = size - data_start
    infos: list[tuple[int, int, TensorInfo]] = []
    for name, entry in obj.items():
        infos.append(_tensor_info(path, name, entry, data_start))
    infos.sort(key=lambda t: (t[0], t[1]))
    expected = 0
    for begin, end, info in infos:
        if begin != expected:
            raise FormatError(
                f"{path}: tensor {info.name!r} starts at byte {begin} of the data, expected {expected} "
                "(overlapping or gapped offsets)"
            )
        expected = end
    if expected > data_len:
        last = infos[-1][2].name
        raise FormatError(
            f"{path}: truncated, tensor {last!r} ends at data byte {expected} but the file holds "
            f"{data_len} data bytes"
        )
    if expected < data_len:
        raise FormatError(f"{path}: {data_len - expected} trailing bytes after the last tensor")
    tensors = {info.name: info for _, _, info in infos}
    return SafetensorsHeader(path, dict(metadata), tensors, data_start, size)


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> tuple[int, int, TensorInfo]:
    if not isinstance(entry, dict):
        raise FormatError(f"{path}: tensor {name!r}: entry is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in ITEMSIZE:
        raise FormatError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FormatError(f"{path}: tensor {name!r}: shape must be a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise FormatError(f"{path}: tensor {name!r}: data_offsets must be [begin, end] with begin <= end")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise FormatError(
            f"{path}: tensor {name!r}: data_offsets span {offsets[1] - offsets[0]} bytes but "
            f"{dtype}{shape} needs {nbytes}"
        )
    info = TensorInfo(name, dtype, tuple(shape), path, data_start + offsets[0], nbytes)
    return offsets[0], offsets[1], info


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor goes in a safetensors file about to be written."""

    header: bytes  # the 8-byte length and the padded JSON
    order: tuple[TensorSpec, ...]
    offsets: dict[str, int]  # absolute file offset of each tensor's first byte
    size: int


def layout_file(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None) -> FileLayout:
    order = sorted(specs, key=lambda s: (-DTYPE_RANK[s.dtype], s.name))
    entries: dict[str, object] = {}
    if metadata is not None:
        entries["__metadata__"] = dict(sorted(metadata.items()))
    pos = 0
    rel: dict[str, int] = {}
    for s in order:
        if s.name in rel:
            raise FormatError(f"tensor {s.name!r} appears twice in one file")
        entries[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        rel[s.name] = pos
        pos += s.nbytes
    body = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * ((8 - len(body) % 8) % 8)
    header = struct.pack("<Q", len(body)) + body
    offsets = {name: len(header) + p for name, p in rel.items()}
    return FileLayout(header, tuple(order), offsets, len(header) + pos)
