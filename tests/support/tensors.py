from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

TORCH_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool,
}


def save_torch_checkpoint(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A checkpoint folder as training frameworks write it (safetensors.torch)."""
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            group = names[i::shards]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in group}, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in group})
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps({"model_type": "test"}))
    return path


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def load_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of a checkpoint folder as (dtype, shape, raw bytes), through safetensors itself."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                out[name] = (str(t.dtype), tuple(t.shape), tensor_bytes(t))
    return out


def random_tensor(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    tdt = TORCH_DTYPES[dtype]
    n = int(np.prod(shape)) if shape else 1
    if dtype == "BOOL":
        return torch.from_numpy(rng.integers(0, 2, n).astype(bool)).reshape(shape)
    if tdt.is_floating_point:
        return torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(tdt).reshape(shape)
    info = torch.iinfo(tdt)
    return torch.from_numpy(rng.integers(info.min, info.max, n, dtype=np.int64, endpoint=True)).to(tdt).reshape(shape)


def perturb(rng: np.random.Generator, t: torch.Tensor, fraction: float) -> torch.Tensor:
    """Flip random bits of a fraction of the bytes (any dtype)."""
    raw = tensor_bytes(t)
    if not raw or fraction == 0:
        return t.clone()
    arr = np.frombuffer(raw, dtype=np.uint8).copy()
    k = max(1, int(len(arr) * fraction))
    idx = rng.choice(len(arr), size=min(k, len(arr)), replace=False)
    arr[idx] ^= rng.integers(1, 256, size=len(idx), dtype=np.uint8)
    if t.dtype == torch.bool:
        arr = (arr & 1).astype(np.uint8)
    return torch.from_numpy(arr).view(t.dtype).reshape(t.shape).clone()


@pytest.fixture
def model_pair(tmp_path: Path):
    """A small model and the same after changing some tensors; every dtype, 0-d, empty and tied."""
    rng = np.random.default_rng(0)
    base = {
        "embed.weight": random_tensor(rng, "BF16", (64, 32)),
        "layer.0.w": random_tensor(rng, "BF16", (32, 32)),
        "layer.0.b": random_tensor(rng, "F32", (32,)),
        "layer.1.w": random_tensor(rng, "F16", (16, 8)),
        "scale": random_tensor(rng, "F64", ()),
        "positions": random_tensor(rng, "I64", (10,)),
        "counts": random_tensor(rng, "I32", (3, 3)),
        "bytes": random_tensor(rng, "U8", (7,)),
        "mask": random_tensor(rng, "BOOL", (5,)),
        "empty": random_tensor(rng, "F32", (0,)),
        "empty2d": random_tensor(rng, "BF16", (4, 0)),
    }
    base["lm_head.weight"] = base["embed.weight"].clone()  # tied: same values under two names
    new = {n: perturb(rng, t, 0.05) for n, t in base.items()}
    new["lm_head.weight"] = new["embed.weight"].clone()
    new["positions"] = base["positions"].clone()  # unchanged: left out of the delta
    return (
        save_torch_checkpoint(tmp_path / "base", base),
        save_torch_checkpoint(tmp_path / "checkpoint-7", new, shards=2),
    )
