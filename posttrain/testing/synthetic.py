"""Synthetic checkpoints for tests, the demo and benchmarks: bf16 weights and an Adam-like step.

Writes ordinary Hugging Face safetensors folders without torch, so generating a 1 GiB pair
costs only numpy time and memory of one tensor at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.safetensors_io import TensorSpec, layout_file

NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "F16": np.float16,
    "BF16": np.uint16, "I32": np.int32, "U32": np.uint32, "F32": np.float32, "F64": np.float64,
    "I64": np.int64, "U64": np.uint64,
}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (as torch casts)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def write_checkpoint(
    path: str | Path,
    tensors: dict[str, tuple[str, np.ndarray]],
    *,
    config: dict | None = None,
    shards: int = 1,
    extra_index_metadata: dict | None = None,
) -> Path:
    """Write ``{name: (dtype, array)}`` as a checkpoint folder (``model.safetensors`` or shards + index)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    groups = [names[i::shards] for i in range(shards)] if shards > 1 else [names]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        _write_file(path / fname, {n: tensors[n] for n in group})
        weight_map.update({n: fname for n in group})
    (path / "config.json").write_text(json.dumps(config or {"model_type": "synthetic"}))
    if shards > 1 or extra_index_metadata:
        total = sum(a.nbytes for _, a in tensors.values())
        meta = {"total_size": total, **(extra_index_metadata or {})}
        (path / INDEX_NAME).write_text(json.dumps({"metadata": meta, "weight_map": weight_map}))
    return path


def _write_file(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    specs = [TensorSpec(n, d, tuple(a.shape), a.nbytes) for n, (d, a) in tensors.items()]
    layout = layout_file(specs, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(layout.header)
        for spec in layout.order:
            f.write(np.ascontiguousarray(tensors[spec.name][1]).tobytes())


def model_shapes(total_bytes: int, hidden: int = 1024, vocab: int = 32768) -> list[tuple[str, tuple[int, ...]]]:
    """Transformer-like bf16 matrices adding up to about ``total_bytes``."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    per_layer = [
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (hidden // 4, hidden)),
        ("self_attn.v_proj.weight", (hidden // 4, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (3 * hidden, hidden)),
        ("mlp.up_proj.weight", (3 * hidden, hidden)),
        ("mlp.down_proj.weight", (hidden, 3 * hidden)),
        ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]
    layer_bytes = 2 * sum(int(np.prod(s)) for _, s in per_layer)
    used = 2 * vocab * hidden * 2  # embeddings and lm_head
    layers = max(1, (total_bytes - used) // layer_bytes)
    for i in range(layers):
        shapes += [(f"model.layers.{i}.{n}", s) for n, s in per_layer]
    shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def adam_like_pair(
    base_dir: str | Path,
    new_dir: str | Path,
    *,
    total_bytes: int,
    lr: float,
    seed: int = 0,
    hidden: int = 1024,
    vocab: int = 32768,
    warmup: int = 10,
) -> tuple[Path, Path]:
    """A bf16 checkpoint and the same after one Adam step at ``lr``, plus small fp32/int64 tensors.

    The fp32 master weights ~ N(0, 0.02) are cast to bf16. The step is Adam's (beta1 0.9, beta2
    0.999, bias-corrected) with moments accumulated over ``warmup`` earlier steps of N(0, 1)
    gradients, as in the middle of a run rather than at its very first step (whose update is
    lr * sign(g) everywhere). Then the master weights are cast again, so only weights whose bf16
    rounding changes differ, as in real bf16 training.
    """
    rng = np.random.default_rng(seed)
    base_t: dict[str, tuple[str, np.ndarray]] = {}
    new_t: dict[str, tuple[str, np.ndarray]] = {}
    for name, shape in model_shapes(total_bytes, hidden, vocab):
        master = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if name.endswith("layernorm.weight"):
            master += np.float32(1.0)
        base_t[name] = ("BF16", to_bf16_bits(master))
        master += np.float32(lr) * adam_update(rng, shape, warmup)
        new_t[name] = ("BF16", to_bf16_bits(master))
        del master
    for name, (dtype, base_arr, new_arr) in _small_tensors(rng, lr).items():
        base_t[name] = (dtype, base_arr)
        new_t[name] = (dtype, new_arr)
    config = {"model_type": "llama", "hidden_size": hidden, "vocab_size": vocab, "torch_dtype": "bfloat16"}
    return (
        write_checkpoint(base_dir, base_t, config=config, shards=2),
        write_checkpoint(new_dir, new_t, config=config, shards=2),
    )


def adam_update(rng: np.random.Generator, shape: tuple[int, ...], steps: int) -> np.ndarray:
    """Adam's normalised update m_hat / (sqrt(v_hat) + eps) after ``steps`` random gradients."""
    m = np.zeros(shape, np.float32)
    v = np.zeros(shape, np.float32)
    for _ in range(steps):
        g = rng.standard_normal(shape, dtype=np.float32)
        m *= np.float32(0.9)
        m += np.float32(0.1) * g
        g *= g
        v *= np.float32(0.999)
        v += np.float32(0.001) * g
    m /= np.float32(1 - 0.9**steps)
    v /= np.float32(1 - 0.999**steps)
    np.sqrt(v, out=v)
    v += np.float32(1e-8)
    m /= v
    return m


def _small_tensors(rng: np.random.Generator, lr: float) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
    scale = rng.standard_normal(4096).astype(np.float32)
    positions = np.arange(8192, dtype=np.int64)
    return {
        "model.rotary_emb.inv_freq": ("F32", scale, scale + np.float32(lr) * rng.standard_normal(4096, dtype=np.float32)),
        "model.position_ids": ("I64", positions, positions.copy()),
        "model.value_head.bias": ("F32", np.zeros(1, np.float32), np.full(1, lr, np.float32)),
    }


def dir_size(path: str | Path) -> int:
    return sum(os.path.getsize(p) for p in Path(path).rglob("*") if p.is_file())


def run_checkpoints(root: str | Path, seed: int, steps: int, *, tensors: int = 4, side: int = 64,
                    changed: int = 40) -> list[Path]:
    """``steps`` checkpoints of a run (``checkpoint-<step>``): ``tensors`` small bf16 matrices,
    ``changed`` of each one's values changing every step."""
    rng = np.random.default_rng(seed)
    state = {f"layer.{i}.weight": rng.integers(0, 1 << 16, (side, side), dtype=np.uint16) for i in range(tensors)}
    out = []
    for step in range(1, steps + 1):
        for arr in state.values():
            idx = rng.choice(arr.size, size=changed, replace=False)
            arr.reshape(-1)[idx] ^= rng.integers(1, 1 << 16, size=changed, dtype=np.uint16)
        out.append(write_checkpoint(Path(root) / f"checkpoint-{step}", {n: ("BF16", a.copy()) for n, a in state.items()}))
    return out
