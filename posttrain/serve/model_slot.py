"""The served model, its atomic swap, and the digests that prove what it holds.

Requests take a reference to the current ``ServedModel`` when they start and keep it to the
end; a hot-load builds the new model beside it and swaps the reference under a lock, so a
request never sees two versions and in-flight requests finish on the weights they began with.

What a model holds is read back from its own parameters (``read_held``: xxh3-128 of each
``state_dict`` tensor as it sits in memory) and compared exactly with what the checkpoint
folder's bytes say it must hold in that dtype (``read_back``, ``posttrain.serve.weight_digest``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.errors import ChainError
from posttrain.serve.weight_digest import Expected, HeldTensor, compare, digest, dtype_name, held_expected


@dataclass(frozen=True)
class ServedModel:
    model: torch.nn.Module
    identity: str | None  # the snapshot it holds; None for boot weights that record none
    path: Path  # the checkpoint folder it was loaded from (the held base of the next delta)
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(repr=False)
    # each state_dict tensor as it must be held (dtype, shape, digest): read back once, at load
    expected: Mapping[str, Expected] = field(default_factory=dict, repr=False, compare=False)


class ModelSlot:
    def __init__(self, served: ServedModel):
        self._lock = threading.Lock()
        self._served = served

    def current(self) -> ServedModel:
        with self._lock:
            return self._served

    def swap(self, new: ServedModel) -> ServedModel:
        """Serve ``new`` from the next request on; returns the model it replaced."""
        with self._lock:
            old, self._served = self._served, new
        return old


def resolve_device(device: str) -> torch.device:
    """The torch device ``device`` names; ValueError (naming it) for one this machine does not have."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        found = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device (--device) {device!r}: not a torch device (auto, cpu, cuda, cuda:N)") from None
    if found.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (found.index or 0) >= count:
            raise ValueError(f"device (--device) {device!r}: this machine has {count} CUDA device(s)"
                             + (f" (cuda:0..cuda:{count - 1})" if count else ""))
    elif found.type not in ("cpu", "mps"):
        raise ValueError(f"device (--device) {device!r}: not supported (auto, cpu, cuda, cuda:N)")
    return found


def recorded_version(path: Path) -> str | None:
    """The snapshot identity a checkpoint folder records (posttrain's reconstructions do), if any."""
    index = path / INDEX_NAME
    if not index.is_file():
        return None
    try:
        meta = json.loads(index.read_text()).get("metadata") or {}
    except (OSError, ValueError):
        return None
    version = meta.get("version") if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version else None


def layout_of(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def load_model(path: Path, device: torch.device, dtype: torch.dtype | str = "auto") -> torch.nn.Module:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: dtype})
    return model.to(device).eval()


def load_served(path: Path, device: torch.device, *, like: ServedModel | None = None,
                identity: str | None = None) -> ServedModel:
    """Load a checkpoint folder; with ``like``, refuse one whose tensors differ in name, shape or dtype."""
    from posttrain.serve.checks import LayoutMismatch
    from posttrain.serve.stages import stage

    dtype = next(like.model.parameters()).dtype if like is not None else "auto"
    model = load_model(path, device, dtype)
    with stage("validate"):
        layout = layout_of(model)
        if like is not None and layout != like.layout:
            changed = sorted(set(layout) ^ set(like.layout)) or sorted(
                k for k in layout if layout[k] != like.layout.get(k)
            )
            raise LayoutMismatch(f"the snapshot's tensors do not fit the served model (first differences: "
                                 f"{changed[:5]})")
    return ServedModel(model, identity if identity is not None else recorded_version(path), path, layout)


def finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or infinity. Its sum is finite only then (or overflows: then counted
    exactly): one pass over memory, on the CPU ten times faster than ``isfinite(t).all()``."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def read_held(model: torch.nn.Module, *, check_finite: bool = True) -> dict[str, HeldTensor]:
    """Each ``state_dict`` tensor as ``model`` holds it now (dtype, shape, digest, finite: not looked at
    without ``check_finite``, for digests compared with some already found finite). Tensors that are one
    (a tied LM head and the embeddings) are hashed once."""
    out: dict[str, HeldTensor] = {}
    seen: dict[tuple, HeldTensor] = {}
    for name, t in model.state_dict().items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        held = seen.get(key)
        if held is None:
            held = seen[key] = HeldTensor(dtype_name(t.dtype), tuple(t.shape), digest(t),
                                          finite(t) if check_finite else True)
        out[name] = held
    return out


def expected_of(held: Mapping[str, HeldTensor], folder: Path) -> dict[str, Expected]:
    """What each tensor of ``held`` must be: ``folder``'s tensor cast to the dtype it is held in (a tied LM
    head: the embeddings). ValueError naming the folder and tensor when the folder cannot say."""
    by_dtype: dict[str, list[str]] = {}
    for name, h in held.items():
        by_dtype.setdefault(h.dtype, []).append(name)
    out: dict[str, Expected] = {}
    try:
        for dtype, names in by_dtype.items():
            out.update(held_expected(folder, names, dtype))
    except ChainError as e:
        raise ValueError(f"cannot read what {folder} holds, to compare the loaded model with: {e}") from None
    return out


def read_back(served: ServedModel, version: str) -> ServedModel:
    """``served`` with the digests it must keep holding, once its parameters are read back and found to be
    exactly those of its folder (``version`` names it in the reason); ValueError with the reason, naming
    the tensors that differ or hold NaN or infinity, when they are not."""
    held = read_held(served.model)
    expected = expected_of(held, served.path)
    verdict = compare(expected, held, what="the parameters the reference engine loaded", version=version)
    if not verdict.ok:
        raise ValueError(verdict.reason)
    return replace(served, expected=expected)


def check_held(served: ServedModel, version: str) -> str | None:
    """Why ``served``'s parameters are not (any longer) those read back at its load; None when they are.
    Digests only: the same bytes as at load are as finite as then; a tensor that differs is looked at."""
    if not served.expected:
        return None
    held = read_held(served.model, check_finite=False)
    verdict = compare(served.expected, held, what="the parameters the reference engine serves", version=version,
                      exhaustive=True)
    if verdict.ok:
        return None
    tensors = served.model.state_dict()
    for name in verdict.differing:
        if name in tensors and not finite(tensors[name]):
            held[name] = replace(held[name], finite=False)
    return compare(served.expected, held, what="the parameters the reference engine serves", version=version,
                   exhaustive=True).reason
