"""Checksums of every file of a snapshot or rebuilt checkpoint: ``posttrain.checksums.json``.

The chain format has no checksum for a full snapshot, and a delta's checksums cover only the
tensors it changes, so a flipped byte of a full snapshot would flow into every later version.
posttrain therefore writes one more file into every snapshot and rebuilt checkpoint it makes.
Consumers that never heard of it are unaffected: slime's reader reads ``*.safetensors``,
CoreWeave's the index, its shards and ``config.json``.

The file is canonical JSON (sorted keys, one-space indent, a final newline; any other bytes are
corruption), with the xxh3-128 of its own canonical form without that key::

    {"files": {name: entry, ...}, "format": "posttrain-checksums-v1", "xxh3_128": "<hex>"}

    entry: {"size": n, "xxh3_128": hex}                     checked whole when the folder is opened
           {"size": n, "header_size": h, "header_xxh3_128": hex, "tensors": {tensor: hex}}
                                                            a shard: its header checked when opened,
                                                            each tensor's bytes as they are read

The safetensors header's offsets tile the data exactly (``read_header`` refuses gaps and trailing
bytes), so a shard's header and its tensors cover every byte of it. A folder without the file
(written by another producer, or by an older posttrain) is read as before, unchecked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import xxhash

from posttrain.chain.errors import ChecksumMismatch
from posttrain.chain.safetensors_io import read_header
from posttrain.fsutil import atomic_write

MANIFEST_NAME = "posttrain.checksums.json"
FORMAT = "posttrain-checksums-v1"
READ_BYTES = 8 << 20


def _canonical(obj: object) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode()


def _digest_range(fd: int, offset: int, n: int) -> str:
    h = xxhash.xxh3_128()
    end = offset + n
    while offset < end:
        data = os.pread(fd, min(READ_BYTES, end - offset), offset)
        if not data:
            break
        h.update(data)
        offset += len(data)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _digest_range(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@dataclass
class Manifest:
    folder: Path
    label: str  # how errors name the folder: "snapshot <identity>"
    files: dict[str, dict]
    origin: str | None = None  # where errors say the files came from (a store), else the folder

    def fail(self, name: str, why: str) -> ChecksumMismatch:
        return ChecksumMismatch(f"{self.label}: file {name} is corrupted ({why}); {self.where(name)}")

    def where(self, name: str) -> str:
        return f"{self.origin}/{name}" if self.origin else str(self.folder / name)

    def check_bytes(self, name: str, data: bytes) -> None:
        """A whole file's bytes (read some other way, e.g. from a store) against the record."""
        entry = self.files.get(name)
        if entry is None or "xxh3_128" not in entry:
            raise ChecksumMismatch(f"{self.label}: file {name} is not in its {MANIFEST_NAME}; {self.where(name)}")
        if len(data) != entry["size"]:
            raise self.fail(name, f"{len(data)} bytes, {MANIFEST_NAME} records {entry['size']}")
        got = xxhash.xxh3_128_hexdigest(data)
        if got != entry["xxh3_128"]:
            raise self.fail(name, f"xxh3-128 is {got}, {MANIFEST_NAME} records {entry['xxh3_128']}")

    def check(self, name: str) -> None:
        """Size, and the whole file or a shard's header, against the record."""
        entry = self.files.get(name)
        if entry is None:
            raise ChecksumMismatch(f"{self.label}: file {name} is not in its {MANIFEST_NAME}; {self.where(name)}")
        path = self.folder / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ChecksumMismatch(f"{self.label}: file {name} is missing ({MANIFEST_NAME} lists it); "
                                   f"{self.where(name)}") from None
        try:
            size = os.fstat(fd).st_size
            if size != entry["size"]:
                raise self.fail(name, f"{size} bytes, {MANIFEST_NAME} records {entry['size']}")
            if "tensors" in entry:
                got, want = _digest_range(fd, 0, entry["header_size"]), entry["header_xxh3_128"]
                what = "its safetensors header's xxh3-128"
            else:
                got, want = _digest_range(fd, 0, size), entry["xxh3_128"]
                what = "xxh3-128"
        finally:
            os.close(fd)
        if got != want:
            raise self.fail(name, f"{what} is {got}, {MANIFEST_NAME} records {want}")

    def check_all(self, *, deep: bool = False) -> None:
        """Every listed file; ``deep`` also reads every tensor of every shard."""
        for name in sorted(self.files):
            self.check(name)
            entry = self.files[name]
            if deep and "tensors" in entry:
                self._check_tensors(name, entry)

    def _check_tensors(self, name: str, entry: dict) -> None:
        header = read_header(self.folder / name)
        if set(header.tensors) != set(entry["tensors"]):
            raise self.fail(name, f"its tensors differ from those {MANIFEST_NAME} records")
        fd = os.open(self.folder / name, os.O_RDONLY)
        try:
            for tname, info in header.tensors.items():
                got = _digest_range(fd, info.offset, info.nbytes)
                if got != entry["tensors"][tname]:
                    raise self.fail(name, f"tensor {tname!r} has xxh3-128 {got}, {MANIFEST_NAME} records "
                                          f"{entry['tensors'][tname]}")
        finally:
            os.close(fd)


def load_manifest(folder: str | os.PathLike[str], label: str | None = None,
                  origin: str | None = None) -> Manifest | None:
    """The folder's checksums, self-checked; None when it has none."""
    folder = Path(folder)
    try:
        raw = (folder / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        return None
    return parse_manifest(raw, folder, label or f"snapshot {folder.name}", origin)


def parse_manifest(raw: bytes, folder: Path, label: str, origin: str | None = None) -> Manifest:
    where = f"{origin}/{MANIFEST_NAME}" if origin else folder / MANIFEST_NAME
    bad = ChecksumMismatch(f"{label}: file {MANIFEST_NAME} is corrupted (not the bytes posttrain wrote); {where}")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise bad from None
    if not isinstance(obj, dict) or _canonical(obj) != raw or obj.get("format") != FORMAT:
        raise bad
    recorded = obj.pop("xxh3_128", None)
    if recorded != xxhash.xxh3_128_hexdigest(_canonical(obj)) or not _well_formed(obj.get("files")):
        raise bad
    return Manifest(folder, label, obj["files"], origin)


def _well_formed(files: object) -> bool:
    if not isinstance(files, dict):
        return False
    for entry in files.values():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            return False
        if "tensors" in entry:
            if not (isinstance(entry.get("header_size"), int) and isinstance(entry.get("header_xxh3_128"), str)
                    and isinstance(entry["tensors"], dict)):
                return False
        elif not isinstance(entry.get("xxh3_128"), str):
            return False
    return True


def write_manifest(folder: str | os.PathLike[str], tensor_digests: Mapping[str, str] | None = None) -> None:
    """Record every file of ``folder`` (hidden ones aside). A shard whose every tensor has a digest
    in ``tensor_digests`` (computed while its bytes were written) is recorded tensor by tensor;
    any other file is read and recorded whole."""
    folder = Path(folder)
    files: dict[str, dict] = {}
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or p.name == MANIFEST_NAME or not p.is_file():
            continue
        size = p.stat().st_size
        if tensor_digests is not None and p.suffix == ".safetensors":
            header = read_header(p)
            if all(t in tensor_digests for t in header.tensors):
                fd = os.open(p, os.O_RDONLY)
                try:
                    head = _digest_range(fd, 0, header.data_start)
                finally:
                    os.close(fd)
                files[p.name] = {"size": size, "header_size": header.data_start, "header_xxh3_128": head,
                                 "tensors": {t: tensor_digests[t] for t in sorted(header.tensors)}}
                continue
        files[p.name] = {"size": size, "xxh3_128": file_digest(p)}
    obj: dict[str, object] = {"files": files, "format": FORMAT}
    obj["xxh3_128"] = xxhash.xxh3_128_hexdigest(_canonical(obj))
    atomic_write(folder / MANIFEST_NAME, _canonical(obj))
