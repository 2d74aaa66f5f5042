"""The dtype a checkpoint is saved in, and the float32 weights kept beside a coarser one.

Training on a CPU runs in float32 (``bf16: false``), but a real model ships in bfloat16: saved as
trained, each checkpoint would be twice the base's size, and every engine that serves the base's
dtype would compute on other weights than the checkpoint's probe was computed on. So a checkpoint
holds its weights in ``save_dtype`` (``auto``: the base's, read from its safetensors headers), and
the probe is computed on exactly those (``saved_model``).

Rounding float32 weights to bfloat16 after every update would lose each update smaller than half a
bfloat16 step (2^-9 relative): at a learning rate of 1e-6 nearly all of them. The policy therefore
stays in float32 in memory (resident mode) and, where it is loaded again (the next step of a job per
round, a resume), from ``master-weights.pt``: the float32 weights of the checkpoint, written with it
whenever the saved dtype is coarser. Engines never read that file (it is not a safetensors file, so
publishing skips it), as they never read ``optimizer.pt``.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import Counter
from pathlib import Path

import torch

from posttrain.chain.checkpoint import INDEX_NAME, SINGLE_NAME
from posttrain.chain.errors import FormatError
from posttrain.chain.safetensors_io import read_header
from posttrain.lora.adapter import LoraError, is_adapter_dir, read_adapter

log = logging.getLogger(__name__)

MASTER_FILE = "master-weights.pt"
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}


def weights_dtype(model_dir: str | Path) -> str:
    """The dtype of a model folder's floating-point weights (the most common one in its safetensors
    headers; config.json's ``dtype`` / ``torch_dtype`` when it has no safetensors file; else float32).
    A LoRA adapter folder: its base's."""
    folder = Path(model_dir)
    if is_adapter_dir(folder):
        try:
            folder = Path(read_adapter(folder).base_path)
        except LoraError:
            return "float32"
    files = [folder / SINGLE_NAME] if (folder / SINGLE_NAME).is_file() else []
    if not files and (folder / INDEX_NAME).is_file():
        try:
            index = json.loads((folder / INDEX_NAME).read_text())
            files = [folder / name for name in dict.fromkeys(index.get("weight_map", {}).values())]
        except (OSError, ValueError, AttributeError):
            files = []
    counts: Counter[str] = Counter()
    for path in files:
        try:
            header = read_header(path)
        except (OSError, FormatError):
            continue
        counts.update(_SAFETENSORS_DTYPES[t.dtype] for t in header.tensors.values() if t.dtype in _SAFETENSORS_DTYPES)
    if counts:
        return counts.most_common(1)[0][0]
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    declared = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return declared if declared in _BITS else "float32"


def resolve_save_dtype(setting: str, model_dir: str | Path) -> torch.dtype:
    """``save_dtype`` as a torch dtype: the setting itself, or (``auto``) the dtype of ``model_dir``'s weights."""
    name = weights_dtype(model_dir) if setting == "auto" else setting
    return getattr(torch, name)


def is_coarser(saved: torch.dtype, trained: torch.dtype) -> bool:
    """Whether weights saved in ``saved`` lose what ``trained`` holds (bfloat16 or float16 from float32)."""
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return saved != trained and _BITS.get(name(saved), 32) < _BITS.get(name(trained), 32)


def saved_model(model, dtype: torch.dtype):
    """The model as it is saved: ``model`` itself in ``dtype``, else a copy whose parameters are cast
    to it (the training weights in memory are left as they are).

    Only the parameters: buffers such as the rotary embedding's ``inv_freq`` stay float32, as
    ``from_pretrained`` keeps them when it loads the saved folder in ``dtype``. Cast too (``.to``),
    they would move every position's angle and the probe would describe a model no engine serves
    (0.16 apart on SmolLM2-135M's probe, past bfloat16's tolerance)."""
    if next(model.parameters()).dtype == dtype:
        return model
    saved = copy.deepcopy(model)
    with torch.no_grad():
        for param in saved.parameters():  # a tied weight is one Parameter: cast once, still shared
            param.data = param.data.to(dtype)
    saved.config.dtype = str(dtype).removeprefix("torch.")  # config.json: the dtype engines load it in
    return saved


def save_master(model, folder: Path) -> None:
    """Write the model's weights as trained (float32) into ``folder/master-weights.pt``."""
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, folder / MASTER_FILE)


def load_master(model, folder: Path) -> bool:
    """Load ``folder/master-weights.pt`` into ``model`` when the folder has one; False when it has none.

    Raises:
        ValueError: the file does not fit the model (other names or shapes); the message names the file.
    """
    path = Path(folder) / MASTER_FILE
    if not path.is_file():
        return False
    state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise ValueError(f"{path}: does not fit the model ({str(e).splitlines()[0]})") from None
    # tied weights appear once in the file and twice in the module: only real gaps count
    missing = [k for k in missing if k not in _tied_names(model)]
    if missing or unexpected:
        raise ValueError(f"{path}: does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    log.info("loaded the float32 weights of %s", path)
    return True


def _tied_names(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if not isinstance(tied, dict) else set(tied) | set(tied.values())
