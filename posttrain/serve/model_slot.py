"""The served model and its atomic swap.

Requests take a reference to the current ``ServedModel`` when they start and keep it to the
end; a hot-load builds the new model beside it and swaps the reference under a lock, so a
request never sees two versions and in-flight requests finish on the weights they began with.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posttrain.chain.checkpoint import INDEX_NAME


@dataclass(frozen=True)
class ServedModel:
    model: torch.nn.Module
    identity: str | None  # the snapshot it holds; None for boot weights that record none
    path: Path  # the checkpoint folder it was loaded from (the held base of the next delta)
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(repr=False)


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
