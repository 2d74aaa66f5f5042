"""Reading snapshots back: a full snapshot is a checkpoint; a delta is changed tensors' zstd frames."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from posttrain.chain.checkpoint import INDEX_NAME, Checkpoint, read_json
from posttrain.chain.errors import FormatError
from posttrain.chain.format import new_checksum
from posttrain.chain.manifest import MANIFEST_NAME, load_manifest
from posttrain.chain.safetensors_io import TensorInfo, read_header


@dataclass(frozen=True)
class DeltaEntry:
    name: str
    frame: TensorInfo  # the compressed bytes, a 1-D U8 tensor
    checksum: str  # of the tensor's bytes after applying this delta


@dataclass
class DeltaSnapshot:
    path: Path
    version: str
    base_version: str
    checksum_format: str
    entries: dict[str, DeltaEntry]

    @property
    def stored_bytes(self) -> int:
        return sum(p.stat().st_size for p in {e.frame.path for e in self.entries.values()})


def is_delta_index(index: dict) -> bool:
    meta = index.get("metadata")
    return isinstance(meta, dict) and "delta_encoding" in meta


def read_index(path: Path) -> dict:
    """A snapshot's index; checked against the snapshot's checksums file when it has one."""
    manifest = load_manifest(path)
    if manifest is not None:
        manifest.check(INDEX_NAME)
    return read_json(path / INDEX_NAME, "snapshot index")


def open_delta(path: str | Path) -> DeltaSnapshot:
    """A delta snapshot, every file checked whole against its checksums file when it has one
    (without one, the per-tensor checksums of the format are all there is)."""
    path = Path(path)
    index_path = path / INDEX_NAME
    manifest = load_manifest(path)
    if manifest is not None:
        manifest.check_all()
        manifest.check(INDEX_NAME)  # refused when it is not listed
    index = read_json(index_path, "snapshot index")
    meta = index.get("metadata")
    if not is_delta_index(index):
        raise FormatError(f"{index_path}: not a delta snapshot (no delta_encoding in metadata)")
    for key in ("version", "base_version"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise FormatError(f"{index_path}: metadata.{key} must be a non-empty string")
    if meta.get("delta_encoding") != "xor":
        raise FormatError(f"{index_path}: delta_encoding {meta.get('delta_encoding')!r} is not supported (xor)")
    if meta.get("compression_format") != "zstd":
        raise FormatError(
            f"{index_path}: compression_format {meta.get('compression_format')!r} is not supported (zstd)"
        )
    fmt = meta.get("checksum_format")
    try:
        new_checksum(fmt)
    except FormatError as e:
        raise FormatError(f"{index_path}: {e}") from None
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise FormatError(f"{index_path}: weight_map must be an object")
    entries: dict[str, DeltaEntry] = {}
    headers = {}
    for fname in sorted(set(weight_map.values())):
        if not isinstance(fname, str) or "/" in fname or fname in ("", ".", ".."):
            raise FormatError(f"{index_path}: shard name {fname!r} is not a file of the snapshot")
        if not (path / fname).is_file():
            raise FormatError(f"{index_path}: names shard {fname!r}, which does not exist")
        if manifest is not None and fname not in manifest.files:
            raise FormatError(f"snapshot {path.name}: file {fname} is not in its {MANIFEST_NAME}")
        headers[fname] = read_header(path / fname)
    for name, fname in weight_map.items():
        header = headers[fname]
        frame = header.tensors.get(name)
        if frame is None:
            raise FormatError(f"{path / fname}: does not hold tensor {name!r} that the index maps to it")
        if frame.dtype != "U8" or len(frame.shape) != 1:
            raise FormatError(f"{path / fname}: tensor {name!r} is {frame.dtype}{list(frame.shape)}, not 1-D U8")
        checksum = header.metadata.get(name)
        if not checksum:
            raise FormatError(f"{path / fname}: no checksum for tensor {name!r} in the shard metadata")
        entries[name] = DeltaEntry(name, frame, checksum.lower())
    return DeltaSnapshot(path, meta["version"], meta["base_version"], fmt, entries)


def held_version(ckpt: Checkpoint) -> str | None:
    """The version a reconstructed checkpoint says it holds (posttrain records it in its index)."""
    v = ckpt.index_metadata.get("version")
    return v if isinstance(v, str) and v else None
