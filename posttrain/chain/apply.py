"""Apply deltas to a base version in one pass per tensor, verifying every intermediate checksum.

For each tensor, the base bytes are read chunk by chunk and every delta that changed it is
decompressed alongside (one zstd stream each) and XORed in, in chain order; the bytes after
each delta are hashed and compared with the checksum that delta recorded. The result is
written to the output shards, or discarded when only verifying.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from posttrain.chain.checkpoint import CHUNK_BYTES, INDEX_NAME, Checkpoint, ChunkReader, check_tensor_digest
from posttrain.chain.encode import (
    SLICE_BYTES,
    Progress,
    _run_parallel,
    close_readers,
    default_workers,
    write_json_atomic,
)
from posttrain.chain.errors import ChecksumMismatch, FormatError
from posttrain.chain.format import new_checksum
from posttrain.chain.outfiles import preallocate, pwrite_all
from posttrain.chain.safetensors_io import TensorInfo, TensorSpec, layout_file
from posttrain.chain.snapshot import DeltaEntry, DeltaSnapshot
from posttrain.fsutil import atomic_write, fsync_path, write_behind


class _FrameSlice:
    """A file-like view of one tensor's compressed bytes, read with pread."""

    def __init__(self, fd: int, info: TensorInfo):
        self.fd, self.pos, self.end = fd, info.offset, info.offset + info.nbytes

    def read(self, n: int = -1) -> bytes:
        n = self.end - self.pos if n < 0 else min(n, self.end - self.pos)
        data = os.pread(self.fd, n, self.pos) if n > 0 else b""
        self.pos += len(data)
        return data


class _Local(threading.local):
    def __init__(self, readers: list[ChunkReader]) -> None:
        self.reader = ChunkReader()
        readers.append(self.reader)  # closed by the caller: a thread-local's data is dropped unclosed
        self.scratch = np.empty(SLICE_BYTES, dtype=np.uint8)
        self.xor = np.empty(SLICE_BYTES, dtype=np.uint8)


@dataclass
class Applied:
    version_digests: dict[str, str]  # tensor -> xxh3-128 of the reconstructed bytes
    bytes: int


def _check_deltas(base: Checkpoint, deltas: list[DeltaSnapshot]) -> None:
    for d in deltas:
        for name in d.entries:
            if name not in base.tensors:
                raise FormatError(f"{d.path}: delta changes tensor {name!r}, which the base does not have")


def apply_chain(
    base: Checkpoint,
    deltas: list[DeltaSnapshot],
    out: Path | None,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
    durable: bool = True,
) -> Applied:
    """Reconstruct ``base`` + ``deltas`` into ``out`` (an existing empty folder), or just verify."""
    _check_deltas(base, deltas)
    readers: list[ChunkReader] = []
    local = _Local(readers)
    fds: dict[Path, int] = {}
    fd_lock = threading.Lock()

    def frame_fd(path: Path) -> int:
        with fd_lock:
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            return fds[path]

    targets: dict[str, tuple[int, int, threading.Lock]] = {}
    out_fds: list[int] = []
    try:
        if out is not None:
            by_file: dict[str, list[TensorInfo]] = {}
            for info in base.tensors.values():
                by_file.setdefault(info.path.name, []).append(info)
            for fname, infos in sorted(by_file.items()):
                specs = [TensorSpec(i.name, i.dtype, i.shape, i.nbytes) for i in infos]
                layout = layout_file(specs, base.shard_metadata.get(fname) or {"format": "pt"})
                fd = os.open(out / fname, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                out_fds.append(fd)
                pwrite_all(fd, memoryview(layout.header), 0)
                preallocate(fd, layout.size)
                # One writer per file at a time: a write holds the file's inode lock while it copies,
                # and a second thread writing the same file spins on that lock in the kernel, burning
                # the CPU the first one needs (perf: a third of apply's time, and most of its variance).
                # Waiting on this lock sleeps instead, and the thread decodes while another writes.
                file_lock = threading.Lock()
                for i in infos:
                    targets[i.name] = (fd, layout.offsets[i.name], file_lock)

        def run(name: str) -> tuple[str, str]:
            info = base.tensors[name]
            chain = [(d, d.entries[name]) for d in deltas if name in d.entries]
            target = targets.get(name)
            digest = _apply_tensor(info, chain, target, local, frame_fd, progress, base.expected.get(name))
            return name, digest

        order = _interleave_files(base)
        digests = dict(_run_parallel(run, order, workers or default_workers()))
        if durable:
            for fd in out_fds:
                os.fsync(fd)
    finally:
        for fd in out_fds:
            os.close(fd)
        for fd in fds.values():
            os.close(fd)
        close_readers(readers)
    return Applied({n: digests[n] for n in base.tensors}, base.total_bytes)


def adopt_full(base: Checkpoint, out: Path, *, workers: int | None = None, progress: Progress | None = None,
               durable: bool = True) -> Applied:
    """Rebuild a full snapshot by moving its shard files into ``out`` (an existing empty folder)
    instead of writing them again. Every tensor is still read and checked against the digest its
    snapshot recorded, as ``apply_chain`` checks it, before anything moves. The snapshot's folder
    loses its shards: only for a caller that drops it afterwards (a hot-load's download cache)."""
    readers: list[ChunkReader] = []
    local = _Local(readers)
    try:
        def run(name: str) -> tuple[str, str]:
            info = base.tensors[name]
            return name, _apply_tensor(info, [], None, local, None, progress, base.expected.get(name))

        digests = dict(_run_parallel(run, _interleave_files(base), workers or default_workers()))
    finally:
        close_readers(readers)
    for path in sorted({info.path for info in base.tensors.values()}):
        shutil.move(path, out / path.name)  # a rename on one file system
        if durable:
            fsync_path(out / path.name)
    return Applied({n: digests[n] for n in base.tensors}, base.total_bytes)


def _interleave_files(base: Checkpoint) -> list[str]:
    """Largest tensors first, taking turns between files: threads writing different files do not
    queue on one file's lock (a buffered write holds its inode's lock while it copies)."""
    by_file: dict[str, list[str]] = {}
    for name in sorted(base.tensors, key=lambda n: -base.tensors[n].nbytes):
        by_file.setdefault(base.tensors[name].path.name, []).append(name)
    return [n for turn in itertools.zip_longest(*by_file.values()) for n in turn if n is not None]


def _apply_tensor(
    info: TensorInfo,
    chain: list[tuple[DeltaSnapshot, DeltaEntry]],
    target: tuple[int, int, threading.Lock] | None,
    local: _Local,
    frame_fd,
    progress: Progress | None,
    expected: str | None = None,
) -> str:
    """Stream one tensor through its deltas; ``expected``: the xxh3-128 the base bytes must have."""
    streams = []
    for delta, entry in chain:
        src = _FrameSlice(frame_fd(entry.frame.path), entry.frame)
        reader = zstandard.ZstdDecompressor().stream_reader(src, read_size=1 << 20, read_across_frames=False)
        streams.append((delta, entry, reader, new_checksum(delta.checksum_format)))
    digest = xxhash.xxh3_128()
    base_digest = xxhash.xxh3_128() if expected is not None and streams else digest
    pos = 0
    try:
        for chunk in local.reader.chunks(info):
            m = len(chunk)
            if base_digest is not digest:
                base_digest.update(chunk)
            for start in range(0, m, SLICE_BYTES):  # slices stay in cache from XOR to write
                work = chunk[start : start + SLICE_BYTES]  # read-only until a delta writes into scratch
                k = len(work)
                for delta, entry, reader, checksum in streams:
                    xor = local.xor[:k]
                    _read_exact(reader, xor, delta, entry, info)
                    out = local.scratch[:k]
                    np.bitwise_xor(work, xor, out=out)
                    work = out
                    checksum.update(work)
                digest.update(work)
                if target is not None:
                    with target[2]:
                        pwrite_all(target[0], work, target[1] + pos + start)
            if target is not None:
                write_behind(target[0], target[1] + pos, m)
            pos += m
            if progress:
                progress(m)
            del chunk, work
        check_tensor_digest(info, base_digest.hexdigest(), expected)
        for delta, entry, reader, checksum in streams:
            if _safe_read(reader, 1, delta, entry):
                raise FormatError(
                    f"{entry.frame.path}: tensor {entry.name!r} of delta {delta.version} decompresses to more "
                    f"than the tensor's {info.nbytes} bytes"
                )
            got = checksum.hexdigest()
            if got != entry.checksum:
                raise ChecksumMismatch(
                    f"{entry.frame.path}: tensor {entry.name!r} of delta {delta.version} has "
                    f"{delta.checksum_format} {got} after applying it, but the snapshot recorded "
                    f"{entry.checksum} (corrupted data, or applied to a base other than {delta.base_version})"
                )
    finally:
        for _, _, reader, _ in streams:
            reader.close()
    return digest.hexdigest()


def _safe_read(reader, n: int, delta: DeltaSnapshot, entry: DeltaEntry) -> bytes:
    try:
        return reader.read(n)
    except zstandard.ZstdError as e:
        raise FormatError(
            f"{entry.frame.path}: tensor {entry.name!r} of delta {delta.version}: corrupted zstd stream ({e})"
        ) from None


def _read_exact(reader, out: np.ndarray, delta: DeltaSnapshot, entry: DeltaEntry, info: TensorInfo) -> None:
    mv = memoryview(out)
    got = 0
    while got < len(mv):
        try:
            n = reader.readinto(mv[got:])
        except zstandard.ZstdError as e:
            raise FormatError(
                f"{entry.frame.path}: tensor {entry.name!r} of delta {delta.version}: corrupted zstd stream ({e})"
            ) from None
        if n == 0:
            raise FormatError(
                f"{entry.frame.path}: tensor {entry.name!r} of delta {delta.version} decompresses to fewer "
                f"than the tensor's {info.nbytes} bytes"
            )
        got += n


def changed_bytes(delta: DeltaSnapshot) -> int:
    """Non-zero bytes of every XOR stream of a delta: the bytes it changes."""
    total = 0
    buf = np.empty(CHUNK_BYTES, dtype=np.uint8)
    for entry in delta.entries.values():
        with open(entry.frame.path, "rb") as f:
            src = _FrameSlice(f.fileno(), entry.frame)
            with zstandard.ZstdDecompressor().stream_reader(src, read_across_frames=False) as reader:
                while n := _safe_readinto(reader, buf, delta, entry):
                    total += int(np.count_nonzero(buf[:n]))
    return total


def _safe_readinto(reader, buf: np.ndarray, delta: DeltaSnapshot, entry: DeltaEntry) -> int:
    try:
        return reader.readinto(memoryview(buf))
    except zstandard.ZstdError as e:
        raise FormatError(
            f"{entry.frame.path}: tensor {entry.name!r} of delta {delta.version}: corrupted zstd stream ({e})"
        ) from None


def write_checkpoint_index(out: Path, base: Checkpoint, version: str | None, config: bytes | None) -> None:
    """Index of a reconstructed checkpoint; it records the version it holds."""
    metadata: dict[str, object] = {"total_size": base.total_bytes}
    if version is not None:
        metadata["version"] = version
    weight_map = {n: i.path.name for n, i in sorted(base.tensors.items())}
    if config is not None:
        atomic_write(out / "config.json", config)
    write_json_atomic(out / INDEX_NAME, {"metadata": metadata, "weight_map": weight_map})
