"""Write full and XOR+zstd delta snapshots, tensor by tensor, in bounded memory on all cores.

Each worker thread streams one tensor at a time in fixed chunks: numpy XOR, zstandard,
zlib.adler32 and xxhash all release the GIL, so threads use every core. A delta tensor is one
zstd frame (level 1, content size in the header) spooled to disk, so shards can be assembled
in compressed-size order without holding compressed bytes in memory.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from posttrain.chain.checkpoint import (
    INDEX_NAME,
    Checkpoint,
    ChunkReader,
    check_tensor_digest,
    layout_changes,
)
from posttrain.chain.errors import ChainError, LayoutMismatch, WrongBase
from posttrain.chain.format import Flavor, content_digest, new_checksum
from posttrain.chain.outfiles import preallocate, pwrite_all
from posttrain.chain.safetensors_io import TensorInfo, TensorSpec, layout_file
from posttrain.fsutil import atomic_write, write_behind

# zstd level 1's fast strategy with a 128 KiB window instead of its 512 KiB one: on the XOR streams of
# bf16 optimizer steps (short zero runs between changed low bytes) frames come out ~7% smaller and
# ~10% faster. Any zstd decoder reads them; the decompressed stream is what the format fixes.
ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, chain_log=12, hash_log=12, search_log=1, min_match=6, target_length=0,
    strategy=zstandard.STRATEGY_FAST, write_content_size=True, write_checksum=False)
# Each mapped window is worked through in slices this size, so that every step after the first
# touch (checksums, XOR, zero count, zstd) reads from cache rather than memory.
SLICE_BYTES = 1 << 20
_ZEROS = np.zeros(SLICE_BYTES, dtype=np.uint8)
_ZEROS.flags.writeable = False
DEFAULT_MAX_SHARD_BYTES = 1 << 30

Progress = Callable[[int], None]


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class TensorResult:
    name: str
    nbytes: int
    digest: str  # xxh3-128 of the new bytes
    checksum: str | None = None  # in the flavour's checksum format (deltas only)
    changed_bytes: int = 0
    compressed_bytes: int = 0
    spool: Path | None = None
    base_matches: bool = True  # False when the base's bytes differ from the expected digest


@dataclass
class EncodedSnapshot:
    """What was written into a snapshot folder, before its index."""

    kind: str  # "full" or "delta"
    weight_map: dict[str, str]
    files: dict[str, int]  # file name -> bytes
    tensors: dict[str, TensorResult]
    layout: dict[str, tuple[str, tuple[int, ...]]]
    raw_bytes: int  # bytes of the whole model version
    content: str  # content digest of the new version
    checksum_format: str | None = None
    extra_files: dict[str, int] = field(default_factory=dict)

    @property
    def stored_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def changed_tensors(self) -> int:
        return len(self.weight_map) if self.kind == "delta" else len(self.tensors)

    @property
    def density(self) -> float:
        """Share of the model's bytes that differ from the base (1.0 for a full snapshot)."""
        if self.kind == "full" or self.raw_bytes == 0:
            return 1.0
        return sum(t.changed_bytes for t in self.tensors.values()) / self.raw_bytes

    def digests(self) -> dict[str, str]:
        return {name: t.digest for name, t in self.tensors.items()}


class _Buffers(threading.local):
    """Each worker thread's readers and scratch; ``readers`` collects the readers of every thread,
    for the caller to close (a thread-local's data is dropped without closing its descriptors)."""

    def __init__(self, readers: list[ChunkReader]) -> None:
        self.new = ChunkReader()
        self.base = ChunkReader()
        readers += (self.new, self.base)
        self.scratch = np.empty(SLICE_BYTES, dtype=np.uint8)


def close_readers(readers: list[ChunkReader]) -> None:
    for reader in readers:
        reader.close()


def _greedy_shards(items: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = []
    size = 0
    for name, n in items:
        if not shards or (size + n > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards or [[]]


def _run_parallel(fn: Callable, items: list, workers: int) -> list:
    if workers <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="posttrain-codec") as pool:
        return list(pool.map(fn, items))


def write_full(
    new: Checkpoint,
    dest: Path,
    *,
    flavor: Flavor,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    workers: int | None = None,
    progress: Progress | None = None,
    durable: bool = True,
) -> EncodedSnapshot:
    """Copy every tensor of ``new`` into fresh shards under ``dest`` (which must exist)."""
    config = new.config_bytes()
    if config is None:
        raise ChainError(f"{new.path}: config.json missing; a full snapshot carries the model config")
    names = list(new.tensors)
    groups = _greedy_shards([(n, new.tensors[n].nbytes) for n in names], max_shard_bytes)
    weight_map: dict[str, str] = {}
    targets: dict[str, tuple[int, int, threading.Lock]] = {}  # tensor -> (fd, offset, the file's write lock)
    fds: list[int] = []
    files: dict[str, int] = {}
    readers: list[ChunkReader] = []
    local = _Buffers(readers)
    try:
        for i, group in enumerate(groups):
            fname = flavor.shard_name(i, len(groups))
            specs = [TensorSpec(n, new.tensors[n].dtype, new.tensors[n].shape, new.tensors[n].nbytes) for n in group]
            layout = layout_file(specs, {"format": "pt"})
            fd = os.open(dest / fname, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fds.append(fd)
            pwrite_all(fd, memoryview(layout.header), 0)
            preallocate(fd, layout.size)
            files[fname] = layout.size
            file_lock = threading.Lock()  # one writer per file at a time: see apply_chain's
            for n in group:
                weight_map[n] = fname
                targets[n] = (fd, layout.offsets[n], file_lock)

        def copy(name: str) -> TensorResult:
            info = new.tensors[name]
            fd, offset, file_lock = targets[name]
            digest = xxhash.xxh3_128()
            pos = 0
            for chunk in local.new.chunks(info):
                digest.update(chunk)
                with file_lock:
                    pwrite_all(fd, chunk, offset + pos)
                write_behind(fd, offset + pos, len(chunk))
                pos += len(chunk)
                if progress:
                    progress(len(chunk))
                del chunk
            check_tensor_digest(info, digest.hexdigest(), new.expected.get(name))  # a rebuilt folder's record
            return TensorResult(name, info.nbytes, digest.hexdigest(), changed_bytes=info.nbytes)

        order = sorted(names, key=lambda n: -new.tensors[n].nbytes)  # largest first: cores stay busy
        results = {r.name: r for r in _run_parallel(copy, order, workers or default_workers())}
        if durable:
            for fd in fds:
                os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
        close_readers(readers)
    atomic_write(dest / "config.json", config)  # synced: the index, written last, commits the folder
    return _encoded("full", new, results, weight_map, files, extra_files={"config.json": len(config)})


def write_delta(
    new: Checkpoint,
    base: Checkpoint,
    dest: Path,
    *,
    flavor: Flavor,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    workers: int | None = None,
    progress: Progress | None = None,
    expected_base: dict[str, str] | None = None,
    durable: bool = True,
) -> EncodedSnapshot:
    """XOR every tensor of ``new`` with ``base``; changed ones become zstd frames in ``dest``.

    ``expected_base`` maps tensor names to the xxh3-128 digests the base must have (the chain
    head's record): a base with other bytes raises WrongBase instead of writing a delta that
    would decode to garbage.
    """
    changes = layout_changes(new.layout(), base.layout())
    if changes:
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        raise LayoutMismatch(f"{new.path} cannot be a delta against {base.path}: {shown}; write a full snapshot")
    fmt = flavor.checksum_format
    spool_dir = dest / ".spool"
    spool_dir.mkdir()
    readers: list[ChunkReader] = []
    local = _Buffers(readers)

    def encode(name: str) -> TensorResult:
        info, binfo = new.tensors[name], base.tensors[name]
        return _encode_tensor(info, binfo, spool_dir, fmt, local, progress, expected_base,
                              (new.expected.get(name), base.expected.get(name)))

    names = list(new.tensors)
    order = sorted(names, key=lambda n: -new.tensors[n].nbytes)
    try:
        results = {r.name: r for r in _run_parallel(encode, order, workers or default_workers())}
        if expected_base is not None:
            bad = sorted(n for n, r in results.items() if not r.base_matches)
            if bad:
                raise WrongBase(
                    f"{base.path} is not the chain's head version: tensor {bad[0]!r} "
                    f"(and {len(bad) - 1} more) differ from the head's recorded bytes"
                )
        changed = [n for n in names if results[n].spool is not None]
        groups = _greedy_shards([(n, results[n].compressed_bytes) for n in changed], max_shard_bytes)
        weight_map: dict[str, str] = {}
        files: dict[str, int] = {}
        if changed:
            for i, group in enumerate(groups):
                fname = flavor.shard_name(i, len(groups))
                files[fname] = _assemble_shard(dest / fname, [results[n] for n in group], durable)
                weight_map.update({n: fname for n in group})
    finally:
        close_readers(readers)
        for p in spool_dir.iterdir():
            p.unlink()
        spool_dir.rmdir()
    return _encoded("delta", new, results, weight_map, files, checksum_format=fmt)


def _encoded(kind: str, new: Checkpoint, results: dict[str, TensorResult], weight_map: dict[str, str],
             files: dict[str, int], **extra: object) -> EncodedSnapshot:
    """What a full or delta snapshot written to a folder holds, tensors in checkpoint order."""
    tensors = {n: results[n] for n in new.tensors}
    return EncodedSnapshot(kind=kind, weight_map=weight_map, files=files, tensors=tensors, layout=new.layout(),
                           raw_bytes=new.total_bytes, content=_content(new, tensors), **extra)


def _encode_tensor(
    info: TensorInfo,
    binfo: TensorInfo,
    spool_dir: Path,
    fmt: str,
    local: _Buffers,
    progress: Progress | None,
    expected_base: dict[str, str] | None,
    recorded: tuple[str | None, str | None] = (None, None),
) -> TensorResult:
    """One fused pass per window: checksums, XOR, zero count and zstd on each slice while it is in cache.

    Zero slices are held back (counted, not compressed) until a changed one follows, so a tensor
    that did not change never reaches zstd and leaves no spool file. ``recorded``: the xxh3-128 the
    new and the base bytes must have (their checksums files).
    """
    checksum = new_checksum(fmt)
    digest = xxhash.xxh3_128()
    base_digest = xxhash.xxh3_128() if expected_base is not None or recorded[1] is not None else None
    spool = spool_dir / f"{threading.get_ident()}-{xxhash.xxh64_hexdigest(info.name.encode())}.zst"
    changed = 0
    pending = 0  # zero bytes of the XOR stream not yet given to zstd
    scratch = local.scratch
    f = writer = None
    size = 0
    try:
        for cur, old in zip(local.new.chunks(info), local.base.chunks(binfo), strict=True):
            for start in range(0, len(cur), SLICE_BYTES):
                c, o = cur[start : start + SLICE_BYTES], old[start : start + SLICE_BYTES]
                checksum.update(c)
                digest.update(c)
                if base_digest is not None:
                    base_digest.update(o)
                xor = scratch[: len(c)]
                np.bitwise_xor(c, o, out=xor)
                nz = int(np.count_nonzero(xor))
                if nz == 0:
                    pending += len(c)
                    continue
                changed += nz
                if writer is None:
                    f = open(spool, "wb")  # noqa: SIM115 - closed in finally
                    cctx = zstandard.ZstdCompressor(compression_params=ZSTD_PARAMS)
                    writer = cctx.stream_writer(f, size=info.nbytes, closefd=False)
                pending = _write_zeros(writer, pending)
                writer.write(xor)
            if progress:
                progress(len(cur))
            del cur, old
        if writer is not None:
            _write_zeros(writer, pending)
            writer.flush(zstandard.FLUSH_FRAME)
            size = f.tell()
    finally:
        if f is not None:
            f.close()
    check_tensor_digest(info, digest.hexdigest(), recorded[0])
    if base_digest is not None:
        check_tensor_digest(binfo, base_digest.hexdigest(), recorded[1])
    result = TensorResult(info.name, info.nbytes, digest.hexdigest(), checksum.hexdigest(), changed, size,
                          spool if writer is not None else None)
    if base_digest is not None and expected_base is not None and expected_base.get(info.name) != base_digest.hexdigest():
        result.base_matches = False
    return result


def _write_zeros(writer, n: int) -> int:
    while n:
        k = min(n, len(_ZEROS))
        writer.write(_ZEROS[:k])
        n -= k
    return 0


def _assemble_shard(path: Path, tensors: list[TensorResult], durable: bool) -> int:
    specs = [TensorSpec(t.name, "U8", (t.compressed_bytes,), t.compressed_bytes) for t in tensors]
    layout = layout_file(specs, {t.name: t.checksum for t in tensors})
    by_name = {t.name: t for t in tensors}
    with open(path, "xb") as out:
        out.write(layout.header)
        out.flush()
        for spec in layout.order:
            with open(by_name[spec.name].spool, "rb") as src:
                remaining = spec.nbytes
                while remaining:
                    n = os.copy_file_range(src.fileno(), out.fileno(), remaining)
                    if n == 0:
                        raise ChainError(f"{by_name[spec.name].spool}: spool shorter than expected")
                    remaining -= n
        if durable:
            os.fsync(out.fileno())
    return layout.size


def _content(ckpt: Checkpoint, tensors: dict[str, TensorResult]) -> str:
    return content_digest({n: (ckpt.tensors[n].dtype, ckpt.tensors[n].shape, t.digest) for n, t in tensors.items()})


def write_index(dest: Path, encoded: EncodedSnapshot, *, version: str, base_version: str | None) -> None:
    """Write ``model.safetensors.index.json``, the commit marker, last."""
    if encoded.kind == "full":
        metadata: dict[str, object] = {"total_size": encoded.raw_bytes}
    else:
        metadata = {
            "version": version,
            "base_version": base_version,
            "delta_encoding": "xor",
            "compression_format": "zstd",
            "checksum_format": encoded.checksum_format,
        }
    index = {"metadata": metadata, "weight_map": dict(sorted(encoded.weight_map.items()))}
    write_json_atomic(dest / INDEX_NAME, index)


def write_json_atomic(path: Path, obj: object) -> None:
    atomic_write(path, json.dumps(obj, indent=2) + "\n")
