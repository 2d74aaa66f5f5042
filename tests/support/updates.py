"""Versions of a model one real training step apart, and a copy with NaN in one tensor.

At a realistic learning rate one optimizer step moves the weights less than any tolerance on
answers can see; these make such versions (transformers, local folders, offline) for tests that
must tell them apart exactly.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# written by save_pretrained from the model itself; the weights' checksums and probe describe the source
# weights, not the updated ones, so they are not copied either
NOT_COPIED = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
              "posttrain.checksums.json", "posttrain.probe.json"}


def _copy_other_files(src: Path, dst: Path) -> None:
    """The tokenizer, chat template and other files of ``src`` that ``dst`` has not."""
    for path in sorted(src.iterdir()):
        if (path.is_file() and path.name not in NOT_COPIED and not path.name.endswith(".safetensors")
                and not (dst / path.name).exists()):
            shutil.copy2(path, dst / path.name)


def one_update(src: Path, dst: Path, *, lr: float = 1e-6, dtype: str = "float32", seed: int = 0) -> Path:
    """``src``'s causal LM after ONE AdamW step at ``lr`` on a fixed batch of token ids (causal LM loss),
    computed in float32 and saved to ``dst`` in ``dtype`` (safetensors, same tensor names as ``src``),
    with ``src``'s tokenizer and other files. The same arguments give the same bytes."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    src, dst = Path(src), Path(dst)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(src, **{dtype_kw: torch.float32})
        model.train()
        vocab = int(model.config.vocab_size)
        batch = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
    model = model.eval().to(getattr(torch, dtype))
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    _copy_other_files(src, dst)
    return dst


def saved_as(src: Path, dst: Path, dtype: str) -> Path:
    """``src``'s model saved to ``dst`` in ``dtype`` (its values cast, as a trainer saving its float32
    master weights in bfloat16 does), with ``src``'s tokenizer and other files."""
    import torch
    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    AutoModelForCausalLM.from_pretrained(src).to(getattr(torch, dtype)).save_pretrained(dst)
    _copy_other_files(src, dst)
    return dst


def nan_weights(src: Path, dst: Path, tensor: str) -> Path:
    """A copy of the model folder ``src`` at ``dst`` whose tensor ``tensor`` holds NaN (its first value)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from posttrain.chain.checkpoint import Checkpoint

    src, dst = Path(src), Path(dst)
    info = Checkpoint.open(src).tensors.get(tensor)
    if info is None:
        raise ValueError(f"{src} has no tensor {tensor!r}")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("posttrain.checksums.json", "posttrain.probe.json"))
    shard = dst / info.path.name
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is no mapping
    poisoned = tensors[tensor].clone()
    poisoned.view(-1)[0] = torch.nan
    tensors[tensor] = poisoned
    save_file(tensors, str(shard), metadata=metadata)
    return dst
