"""Names, flavours, checksums and identities of the chain format (docs/delta-format.md)."""

from __future__ import annotations

import json
import re
import zlib
from enum import Enum

import xxhash

from posttrain.chain.errors import FormatError

try:  # zlib-ng's SIMD adler32 is ~15x zlib's; same values
    from zlib_ng.zlib_ng import adler32 as _adler32
except ImportError:  # pragma: no cover - zlib-ng is a dependency, but the stdlib's is a correct fallback
    _adler32 = zlib.adler32

IDENTITY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SLIME_DIR_RE = re.compile(r"^weight_v(\d{6})$")
MAX_IDENTITY_LEN = 255
PROBE_NAME = "posttrain.probe.json"  # the probe a snapshot carries (posttrain.chain.probe)
MAX_CHAIN_DELTAS = 128  # deltas a consumer resolves after a full snapshot (CoreWeave's limit)


class Flavor(str, Enum):
    COREWEAVE = "coreweave"
    SLIME = "slime"

    @property
    def checksum_format(self) -> str:
        return "adler32" if self is Flavor.COREWEAVE else "xxh3-128"

    def shard_name(self, i: int, n: int) -> str:
        if self is Flavor.COREWEAVE:
            return f"model-{i:05d}.safetensors"
        return f"model-{i:05d}-of-{n:05d}.safetensors"


def check_identity(identity: str, what: str = "identity") -> str:
    """An identity is one path segment of ``[A-Za-z0-9][A-Za-z0-9_.-]*``."""
    if not isinstance(identity, str) or not identity:
        raise FormatError(f"{what} is empty; it must be one path segment like 'step-00000100-<hex>'")
    if len(identity) > MAX_IDENTITY_LEN or not IDENTITY_RE.fullmatch(identity):
        raise FormatError(
            f"{what} {identity!r} is not one path segment matching [A-Za-z0-9][A-Za-z0-9_.-]*"
        )
    return identity


def slime_dir(version: int) -> str:
    if not 0 <= version <= 999_999:
        raise FormatError(f"slime version {version} is outside 0..999999")
    return f"weight_v{version:06d}"


def parse_slime_version(text: str) -> int:
    """Accepts 3, '000003' or 'weight_v000003'."""
    m = SLIME_DIR_RE.fullmatch(text)
    digits = m.group(1) if m else text
    if not digits.isdigit():
        raise FormatError(f"{text!r} is not a slime version (an integer or weight_vNNNNNN)")
    return int(digits)


class Adler32:
    """zlib.adler32 with the hashlib-style interface the codec uses."""

    def __init__(self) -> None:
        self.value = 1

    def update(self, data: object) -> None:
        self.value = _adler32(data, self.value)

    def hexdigest(self) -> str:
        return "%08x" % self.value


def new_checksum(checksum_format: str) -> Adler32 | xxhash.xxh3_128:
    if checksum_format == "adler32":
        return Adler32()
    if checksum_format == "xxh3-128":
        return xxhash.xxh3_128()
    raise FormatError(f"unsupported checksum_format {checksum_format!r} (adler32 or xxh3-128)")


def content_digest(entries: dict[str, tuple[str, tuple[int, ...], str]]) -> str:
    """Digest of a whole model version from its tensors' (dtype, shape, xxh3-128 of bytes)."""
    h = xxhash.xxh3_128()
    for name in sorted(entries):
        dtype, shape, digest = entries[name]
        h.update(json.dumps([name, dtype, list(shape), digest]).encode())
    return h.hexdigest()


def make_identity(*, run: str, step: int, kind: str, base_identity: str | None, content: str) -> str:
    """Deterministic identity: the same run, step, kind, base and content give the same name."""
    if step < 0:
        raise FormatError(f"step {step} is negative")
    h = xxhash.xxh3_128(json.dumps([run, step, kind, base_identity, content]).encode()).hexdigest()
    return f"step-{step:08d}-{h}"
