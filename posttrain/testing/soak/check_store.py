"""The soak checker's view of the object store: every key under the soak's prefix, read with boto3
directly, and every snapshot verified and rebuilt from its stored bytes without posttrain's codec.

What is re-implemented here (from docs/delta-format.md and docs/layout.md), not imported:

- the safetensors header (8-byte little-endian length, then JSON; offsets tile the data);
- ``posttrain.checksums.json``: canonical JSON (sorted keys, one-space indent, ASCII, final
  newline), its own xxh3-128 over the canonical form without that key, every file's size and
  xxh3-128, a shard's header digest and each tensor's digest;
- a delta: each changed tensor a zstd frame of the XOR against its base's bytes, the new bytes'
  checksum (adler32 as ``%08x``, or xxh3-128) in the shard's ``__metadata__``;
- a version's content digest and its identity (``step-<8 digits>-<xxh3-128 of [run, step, kind,
  base, content]>``), recomputed from the rebuilt bytes and compared with the ledger and the name.

Only third-party libraries are used (boto3, xxhash, zstandard, numpy): a bug in posttrain's codec
or publisher cannot hide itself from this reading.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np
import xxhash
import zstandard

INDEX = "model.safetensors.index.json"
CHECKSUMS = "posttrain.checksums.json"
CONFIG = "config.json"
BOOK = ".posttrain/"
MAX_DELTAS = 128
RUN_KEY_RE = re.compile(r"\.posttrain/runs/([^/]+)/(.+)")
HISTORY_KEY_RE = re.compile(r"\.posttrain/promotions/([^/]+)/(.+)")
DEPLOYMENT_LEASE_RE = re.compile(r"\.posttrain/deployments/([^/]+)/lease\.json")
GC_LEASE_RE = re.compile(r"\.posttrain/gc-leases/([^/]+)\.json")
EVAL_KEY_RE = re.compile(r"\.posttrain/evals/[^/]+/[^/]+\.json")
RUN_FILE_RE = re.compile(r"run\.json|latest\.json|steps/\d+\.json|ledger/[^/]+\.json|leases/publish-[^/]+\.json")
IDENTITY_STEP_RE = re.compile(r"step-(\d{8})-[0-9a-f]{32}")
# safetensors dtype -> numpy dtype of the same width (bf16 kept as its 16-bit patterns)
NP_DTYPES = {"BOOL": np.uint8, "U8": np.uint8, "I8": np.int8, "F8_E5M2": np.uint8, "F8_E4M3": np.uint8,
             "I16": np.int16, "U16": np.uint16, "F16": np.float16, "BF16": np.uint16, "I32": np.int32,
             "U32": np.uint32, "F32": np.float32, "F64": np.float64, "I64": np.int64, "U64": np.uint64}


def s3_client(store: dict, credentials_env: dict):  # noqa: ANN201 - a boto3 client
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=store.get("endpoint_url"), region_name=store.get("region") or "us-east-1",
        aws_access_key_id=os.environ.get(credentials_env.get("access_key", ""), None),
        aws_secret_access_key=os.environ.get(credentials_env.get("secret_key", ""), None),
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}))


class StoreReader:
    """Every object under one prefix of one bucket, listed once; bytes fetched on demand (cached)."""

    def __init__(self, client, bucket: str, prefix: str):
        self.client, self.bucket = client, bucket
        self.prefix = (prefix.strip("/") + "/") if prefix.strip("/") else ""
        self.sizes: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith("/"):
                    continue  # a folder marker some S3 servers list: not an object of the layout
                self.sizes[obj["Key"][len(self.prefix):]] = int(obj["Size"])
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=self.prefix).get("Uploads", [])
        self.open_uploads = [u["Key"][len(self.prefix):] for u in uploads]
        self._cache: dict[str, bytes] = {}

    def get(self, key: str) -> bytes:
        if key not in self._cache:
            body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
            self._cache[key] = body
        return self._cache[key]

    def json(self, key: str) -> object:
        return json.loads(self.get(key))

    def folders(self) -> dict[str, list[str]]:
        """Top-level folders outside the bookkeeping (snapshot folders, whole or partial) -> file names."""
        out: dict[str, list[str]] = {}
        for key in self.sizes:
            if key.startswith(BOOK):
                continue
            head, _, rest = key.partition("/")
            out.setdefault(head, []).append(rest)
        return out

    def has_index(self, identity: str) -> bool:
        return f"{identity}/{INDEX}" in self.sizes


def canonical(obj: object) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode()


def parse_safetensors(data: bytes, what: str) -> tuple[int, dict, dict]:
    """(data start, tensors {name: (dtype, shape, begin, end)}, __metadata__) of a safetensors file."""
    if len(data) < 8:
        raise ValueError(f"{what}: {len(data)} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{what}: header length {n} runs past the file ({len(data)} bytes)")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    tensors, spans = {}, []
    for name, t in header.items():
        begin, end = t["data_offsets"]
        tensors[name] = (t["dtype"], tuple(t["shape"]), 8 + n + begin, 8 + n + end)
        spans.append((begin, end))
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise ValueError(f"{what}: tensor data leaves a gap or overlaps at byte {begin}")
        pos = end
    if 8 + n + pos != len(data):
        raise ValueError(f"{what}: tensor data ends at {8 + n + pos}, the file has {len(data)} bytes")
    return 8 + n, tensors, meta


def tensor_checksum(fmt: str, data: bytes) -> str:
    if fmt == "adler32":
        return "%08x" % zlib.adler32(data)
    if fmt == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(data)
    raise ValueError(f"unknown checksum_format {fmt!r}")


def content_digest(tensors: dict[str, tuple[str, tuple, bytes]]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        h.update(json.dumps([name, dtype, list(shape), xxhash.xxh3_128_hexdigest(data)]).encode())
    return h.hexdigest()


def expected_identity(run: str, step: int, kind: str, base: str | None, content: str) -> str:
    h = xxhash.xxh3_128(json.dumps([run, step, kind, base, content]).encode()).hexdigest()
    return f"step-{step:08d}-{h}"


@dataclass
class Snapshot:
    identity: str
    kind: str = "?"  # full, delta, or ? when its index cannot be read
    base: str | None = None
    problems: list[str] = field(default_factory=list)
    config: bytes | None = None  # config.json (full snapshots)


@dataclass
class Rebuilt:
    """A version rebuilt from the store: tensors {name: (dtype, shape, bytes)}, its chain's config."""

    tensors: dict[str, tuple[str, tuple, bytes]]
    config: bytes | None
    depth: int  # deltas after the full snapshot


def verify_snapshot(store: StoreReader, identity: str, files: list[str]) -> Snapshot:
    """Every file of a stored snapshot against its checksums file, and the index's own rules."""
    snap = Snapshot(identity)
    bad = snap.problems.append
    try:
        index = store.json(f"{identity}/{INDEX}")
        meta = index.get("metadata") or {}
        weight_map = index["weight_map"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        bad(f"snapshot {identity}: its index cannot be read ({e})")
        return snap
    snap.kind = "delta" if "delta_encoding" in meta else "full"
    if snap.kind == "delta":
        snap.base = meta.get("base_version")
        if meta.get("version") != identity:
            bad(f"snapshot {identity}: its index says version {meta.get('version')!r}")
        if meta.get("delta_encoding") != "xor" or meta.get("compression_format") != "zstd":
            bad(f"snapshot {identity}: delta encoding {meta.get('delta_encoding')!r}/"
                f"{meta.get('compression_format')!r}, not xor/zstd")
        if not isinstance(snap.base, str) or not store.has_index(snap.base):
            bad(f"delta snapshot {identity}: its base {snap.base} is not in the store (no index)")
    elif CONFIG not in files:
        bad(f"full snapshot {identity}: no {CONFIG}")
    else:
        snap.config = store.get(f"{identity}/{CONFIG}")
    for shard in set(weight_map.values()):
        if shard not in files:
            bad(f"snapshot {identity}: its index names {shard}, which is not in the store")
    if CHECKSUMS not in files:
        bad(f"snapshot {identity}: no {CHECKSUMS}")
        return snap
    raw = store.get(f"{identity}/{CHECKSUMS}")
    try:
        manifest = json.loads(raw)
        recorded = manifest.pop("xxh3_128")
        ok = canonical({**manifest, "xxh3_128": recorded}) == raw and manifest.get("format") == "posttrain-checksums-v1"
    except (ValueError, KeyError, AttributeError):
        ok, recorded, manifest = False, None, {}
    if not ok or recorded != xxhash.xxh3_128_hexdigest(canonical(manifest)):
        bad(f"snapshot {identity}: {CHECKSUMS} is not the canonical, self-checked file posttrain writes")
        return snap
    listed = manifest.get("files") or {}
    for name in sorted(set(files) - set(listed) - {CHECKSUMS}):
        bad(f"snapshot {identity}: file {name} is in the store but not in its {CHECKSUMS}")
    for name, entry in sorted(listed.items()):
        if name not in files:
            bad(f"snapshot {identity}: file {name} ({CHECKSUMS} lists it) is missing from the store")
            continue
        data = store.get(f"{identity}/{name}")
        if len(data) != entry.get("size"):
            bad(f"snapshot {identity}: file {name} has {len(data)} bytes, {CHECKSUMS} records {entry.get('size')}")
        elif "tensors" in entry:
            _check_shard(snap, name, data, entry)
        elif xxhash.xxh3_128_hexdigest(data) != entry.get("xxh3_128"):
            bad(f"snapshot {identity}: file {name} does not match its xxh3-128 in {CHECKSUMS}")
    return snap


def _check_shard(snap: Snapshot, name: str, data: bytes, entry: dict) -> None:
    where = f"snapshot {snap.identity}: shard {name}"
    if xxhash.xxh3_128_hexdigest(data[:entry["header_size"]]) != entry["header_xxh3_128"]:
        snap.problems.append(f"{where}: its header does not match {CHECKSUMS}")
        return
    try:
        _, tensors, _ = parse_safetensors(data, where)
    except (ValueError, KeyError, TypeError) as e:
        snap.problems.append(str(e))
        return
    if set(tensors) != set(entry["tensors"]):
        snap.problems.append(f"{where}: its tensors differ from those {CHECKSUMS} records")
        return
    for tname, (_, _, begin, end) in tensors.items():
        if xxhash.xxh3_128_hexdigest(data[begin:end]) != entry["tensors"][tname]:
            snap.problems.append(f"{where}: tensor {tname} does not match its xxh3-128 in {CHECKSUMS}")


def rebuild(store: StoreReader, snap: Snapshot, base: Rebuilt | None) -> Rebuilt:
    """The version ``snap`` holds: a full snapshot's tensors, or ``base`` with the delta XORed in,
    every changed tensor's new bytes checked against the delta's own checksum."""
    index = store.json(f"{snap.identity}/{INDEX}")
    meta, weight_map = index.get("metadata") or {}, index["weight_map"]
    shards = {s: parse_safetensors(store.get(f"{snap.identity}/{s}"), f"{snap.identity}/{s}") + (s,)
              for s in set(weight_map.values())}
    if snap.kind == "full":
        out = {}
        for name, shard in weight_map.items():
            _, tensors, _, s = shards[shard]
            dtype, shape, begin, end = tensors[name]
            out[name] = (dtype, shape, store.get(f"{snap.identity}/{s}")[begin:end])
        return Rebuilt(out, snap.config, 0)
    assert base is not None
    fmt = meta.get("checksum_format")
    out = dict(base.tensors)
    for name, shard in weight_map.items():
        if name not in out:
            raise ValueError(f"delta {snap.identity} changes tensor {name}, which its base does not have")
        _, tensors, smeta, s = shards[shard]
        _, _, begin, end = tensors[name]
        dtype, shape, old = out[name]
        xor = zstandard.ZstdDecompressor().decompress(store.get(f"{snap.identity}/{s}")[begin:end],
                                                      max_output_size=len(old))
        if len(xor) != len(old):
            raise ValueError(f"delta {snap.identity}: tensor {name} decompresses to {len(xor)} bytes, not {len(old)}")
        new = (np.frombuffer(old, np.uint8) ^ np.frombuffer(xor, np.uint8)).tobytes()
        if tensor_checksum(fmt, new) != smeta.get(name):
            raise ValueError(f"delta {snap.identity}: tensor {name}'s rebuilt bytes do not match the delta's "
                             f"{fmt} checksum (corrupt, or applied to another base than {snap.base})")
        out[name] = (dtype, shape, new)
    return Rebuilt(out, base.config, base.depth + 1)


def rebuild_all(store: StoreReader, snaps: dict[str, Snapshot]) -> tuple[dict[str, Rebuilt], list[str]]:
    """Every version the store can rebuild (bases first), and why the others cannot be. A snapshot
    that failed verification is not rebuilt (its own problems say why); the versions built on it
    are named as unbuildable, with the snapshot their chain breaks at."""
    done: dict[str, Rebuilt] = {}
    short: dict[str, str] = {}  # identity -> why it is not usable as a base, in a few words
    messages: dict[str, str] = {}
    for identity in sorted(snaps):
        chain, cur, why = [], identity, None
        while cur not in done:
            snap = snaps.get(cur)
            if cur in short:
                why = (cur, short[cur])
            elif snap is None or snap.kind == "?":
                why = (cur, "is not in the store")
            elif snap.problems:
                why = (cur, "failed verification")
            elif cur in chain:
                why = (cur, "is where its base links loop")
            if why:
                break
            chain.append(cur)
            if snap.kind == "full":
                break
            cur = snap.base
        for ident in ([] if why else reversed(chain)):
            snap = snaps[ident]
            try:
                done[ident] = rebuild(store, snap, done.get(snap.base) if snap.kind == "delta" else None)
            except (ValueError, KeyError, TypeError, zstandard.ZstdError) as e:
                why = (ident, f"cannot be rebuilt ({e})")
                break
            if done[ident].depth > MAX_DELTAS:
                messages[ident] = f"snapshot {ident} is {done[ident].depth} deltas after its full snapshot " \
                                  f"(over {MAX_DELTAS})"
        if why is None:
            continue
        at, reason = why
        short.setdefault(identity, "cannot be rebuilt" if at != identity else reason)
        if at == identity and snaps.get(identity) is not None and snaps[identity].problems:
            continue  # its verification problems are reported already
        messages[identity] = (f"snapshot {identity} {reason}" if at == identity else
                              f"snapshot {identity} cannot be rebuilt: its chain needs {at}, which {reason}")
    return done, [messages[i] for i in sorted(messages)]
