"""A decoder-shaped bf16 checkpoint and the same one Adam-like step later, written a tensor at a time.

``posttrain.testing.synthetic.adam_like_pair`` holds both checkpoints in memory, which an 8 GiB pair
does not fit; this writes each tensor of both files as it is drawn, so memory is one tensor's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.safetensors_io import TensorSpec, layout_file
from posttrain.testing.synthetic import adam_update, model_shapes, to_bf16_bits

VOCAB = 32768
WARMUP = 4  # Adam moments of 4 earlier steps: a mid-run update, not the first step's lr * sign(g)


def shapes_of(total_bytes: int, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    return model_shapes(total_bytes, hidden, VOCAB) + [("model.norm.weight", (hidden,))]


def shard_groups(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[TensorSpec]]:
    """Tensors in order, a new file whenever the next would pass ``shard_bytes`` (as save_pretrained does)."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * int(np.prod(shape))
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(TensorSpec(name, "BF16", shape, nbytes))
        size += nbytes
    return groups


def write_pair(base_dir: str, new_dir: str, *, total_bytes: int, lr: float, hidden: int, shard_bytes: int,
               seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    base, new = Path(base_dir), Path(new_dir)
    groups = shard_groups(shapes_of(total_bytes, hidden), shard_bytes)
    weight_map: dict[str, str] = {}
    for i, specs in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        layout = layout_file(specs, {"format": "pt"})
        for folder in (base, new):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / fname).write_bytes(layout.header)
        with open(base / fname, "ab") as fb, open(new / fname, "ab") as fn:
            for spec in layout.order:
                master = rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(0.02)
                if spec.name.endswith("norm.weight"):
                    master += np.float32(1.0)
                fb.write(to_bf16_bits(master).tobytes())
                master += np.float32(lr) * adam_update(rng, spec.shape, WARMUP)
                fn.write(to_bf16_bits(master).tobytes())
                weight_map[spec.name] = fname
    heads = hidden // 128
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": 3 * hidden, "num_hidden_layers": sum(1 for n in weight_map if n.endswith("q_proj.weight")),
              "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "vocab_size": VOCAB,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    total = sum(s.nbytes for g in groups for s in g)
    for folder in (base, new):
        (folder / "config.json").write_text(json.dumps(config))
        (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
