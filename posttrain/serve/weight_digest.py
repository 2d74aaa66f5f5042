"""Which weights an engine holds, proved bit for bit: digests read back from the engine, compared exactly.

Answers compared within a tolerance cannot tell a version from the one before it when one training
step moves them less than the tolerance (at realistic learning rates every step does), and pass NaN.
So every engine reports digests (xxh3-128 of a tensor's bytes as held) computed where the weights
are: the reference engine from its own parameters, vLLM from inside its worker
(``readback_extension``), SGLang through ``get_weights_by_name``. The gateway compares them with
what the snapshot's bytes say they must be:

- **consumed**: the tensors an engine's loader handed to the model during a reload, in the
  checkpoint's own dtype: each must be one of the snapshot's tensors with its exact digest (the
  snapshot's ``posttrain.checksums.json`` records them), none missing, none extra;
- **held**: parameters whose layout in the engine equals the checkpoint's (embeddings, norms, an
  untied LM head: not fused, not sharded, not quantized) as they sit in memory, in the dtype the engine
  computes in: the checkpoint's tensor cast to that dtype, then hashed.

No HTTP and no engine here: the engines' clients fetch, this module decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from posttrain.chain.checkpoint import Checkpoint, ChunkReader
from posttrain.serve.checks import ties_embeddings

if TYPE_CHECKING:
    import torch

# torch is imported when a digest is first computed, not with this module: the CLI sets OpenMP's
# environment before anything loads torch (posttrain.cli.serve.quiet_openmp), and clients import this


def digest(t: torch.Tensor) -> str:
    """xxh3-128 (hex) of ``t``'s bytes as held (``readback_extension.digest``: the engines hash the same way)."""
    from posttrain.serve.readback_extension import digest as engine_digest

    return engine_digest(t)


def describe(t: torch.Tensor) -> list:
    """``[dtype, shape, digest, finite]`` of ``t`` (``readback_extension.describe``)."""
    from posttrain.serve.readback_extension import describe as engine_describe

    return engine_describe(t)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

__all__ = ["Expected", "HeldReport", "HeldTensor", "Readback", "TIED_HEAD", "compare", "consumed_expected", "describe",
           "digest", "dtype_name", "held_expected", "parse_wire"]

TIED_HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
SHOWN = 5  # tensors named in a reason; the rest are counted


@dataclass(frozen=True)
class Expected:
    """What one tensor must be, in the dtype it is compared in."""

    dtype: str
    shape: tuple[int, ...]
    digest: str


@dataclass(frozen=True)
class HeldTensor:
    """One tensor as an engine reported it."""

    dtype: str
    shape: tuple[int, ...]
    digest: str
    finite: bool = True


@dataclass(frozen=True)
class HeldReport:
    """What an engine replica says it holds now: digests of the tensors asked for, the identity of the
    last reload it verified itself (None when it keeps none, or was restarted since), its compute dtype."""

    tensors: dict[str, HeldTensor]
    identity: str | None
    dtype: str


def parse_wire(tensors: object, where: str) -> dict[str, HeldTensor]:
    """``{name: [dtype, shape, digest, finite]}`` as ``describe`` writes it; ValueError naming ``where``."""
    if not isinstance(tensors, dict):
        raise ValueError(f"{where}: expected an object of tensors, got {type(tensors).__name__}")
    out = {}
    for name, entry in tensors.items():
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and isinstance(entry[2], str) and isinstance(entry[3], bool)):
            raise ValueError(f"{where}: tensor {name!r}: not [dtype, shape, digest, finite] ({entry!r})")
        out[str(name)] = HeldTensor(entry[0], tuple(int(d) for d in entry[1]), entry[2], entry[3])
    return out


def _file_digests(ckpt: Checkpoint) -> dict[str, str]:
    """Each tensor's digest as stored: from the checksums file (checked when opened), else hashed now."""
    out = dict(ckpt.expected)
    missing = [info for name, info in ckpt.tensors.items() if name not in out]
    if missing:
        with ChunkReader() as reader:
            for info in missing:
                h = xxhash.xxh3_128()
                for chunk in reader.chunks(info):
                    h.update(chunk)
                out[info.name] = h.hexdigest()
    return out


def consumed_expected(folder: Path) -> dict[str, Expected]:
    """The tensors a loader reading ``folder`` must hand to the model, as stored (dtype, shape, digest)."""
    ckpt = Checkpoint.open(folder)
    digests = _file_digests(ckpt)
    return {name: Expected(SAFETENSORS_DTYPES.get(info.dtype, info.dtype), info.shape, digests[name])
            for name, info in ckpt.tensors.items()}


def held_expected(folder: Path, names: Iterable[str], dtype: str) -> dict[str, Expected]:
    """What each of ``names`` must be in an engine computing in ``dtype``: the folder's tensor cast to
    ``dtype`` (as loaders copy it into a parameter), hashed. A tied LM head is the embeddings."""
    ckpt = Checkpoint.open(folder)
    as_stored = None
    out: dict[str, Expected] = {}
    for name in names:
        source = name
        if name not in ckpt.tensors and name == TIED_HEAD and ties_embeddings(folder):
            source = EMBEDDINGS
        info = ckpt.tensors.get(source)
        if info is None:
            raise ValueError(f"{folder}: has no tensor {name!r} to compare the engine's with")
        if SAFETENSORS_DTYPES.get(info.dtype) == dtype:
            if as_stored is None:
                as_stored = _file_digests(ckpt)
            out[name] = Expected(dtype, info.shape, as_stored[source])
            continue
        import torch

        out[name] = Expected(dtype, info.shape, digest(_load(info).to(getattr(torch, dtype))))
    return out


def _load(info) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(info.path), framework="pt") as f:
        return f.get_tensor(info.name)


@dataclass(frozen=True)
class Readback:
    """The outcome of :func:`compare`: ``ok``, and when not, ``reason`` (one line) and the tensors at fault."""

    ok: bool
    reason: str
    differing: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok


def compare(expected: Mapping[str, Expected], got: Mapping[str, HeldTensor], *, what: str, version: str,
            exhaustive: bool = False) -> Readback:
    """Whether ``got`` (an engine's digests of ``what``: "the tensors its loader read", "its parameters")
    is exactly ``expected`` (``version``'s). Every expected tensor must be there with the same dtype,
    shape and digest and hold no NaN or infinity; ``exhaustive``: no other tensor may be there either."""
    problems: dict[str, str] = {}
    for name, want in expected.items():
        held = got.get(name)
        if held is None:
            problems[name] = "missing"
        elif not held.finite:
            problems[name] = "holds NaN or infinity"
        elif (held.dtype, tuple(held.shape)) != (want.dtype, tuple(want.shape)):
            problems[name] = f"is {held.dtype}{list(held.shape)}, not {want.dtype}{list(want.shape)}"
        elif held.digest != want.digest:
            problems[name] = "differs"
    if exhaustive:
        problems.update({name: "is not in the snapshot" for name in got if name not in expected})
    if not problems:
        return Readback(True, f"{what}: {len(expected)} tensors are exactly {version}'s")
    shown = "; ".join(f"{name} {why}" for name, why in sorted(problems.items())[:SHOWN])
    more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return Readback(False, f"{what}: {len(problems)} of {len(expected)} tensors are not {version}'s "
                           f"({shown}{more})", tuple(sorted(problems)))


def comparable(layout: Mapping[str, HeldTensor], folder: Path) -> dict[str, int | None]:
    """The engine parameters (``layout``: name, dtype, shape) that hold a checkpoint tensor as it is: same
    name and shape (a tied LM head: the embeddings'), or its rows padded past the checkpoint's (a
    vocabulary padded for the kernels: compared on the checkpoint's rows, the value). Fused, sharded and
    repacked ones differ."""
    ckpt = Checkpoint.open(folder)
    out: dict[str, int | None] = {}
    for name, held in sorted(layout.items()):
        source = EMBEDDINGS if name == TIED_HEAD and name not in ckpt.tensors and ties_embeddings(folder) else name
        info = ckpt.tensors.get(source)
        if info is None or not info.shape or len(info.shape) != len(held.shape):
            continue
        if tuple(info.shape) == tuple(held.shape):
            out[name] = None
        elif tuple(info.shape[1:]) == tuple(held.shape[1:]) and held.shape[0] > info.shape[0]:
            out[name] = info.shape[0]
    return out


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding NaN or infinity."""
    import torch

    return sorted(n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))


__all__ += ["comparable", "non_finite"]
