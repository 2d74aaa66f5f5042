"""LoRA test helpers: a base in a given dtype, a peft adapter with non-zero matrices, and peft's
own merge of the two (the reference the streamed merge must equal bit for bit)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def make_base(path: Path, dtype: str = "float32", **tiny) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import build_tiny_model

    build_tiny_model(path, seed=0, **tiny)
    if dtype != "float32":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(getattr(torch, dtype))
        model.save_pretrained(path)
    return path


def make_adapter(base: Path, out: Path, *, seed: int = 1, adapter_dtype: str | None = None, r: int = 4,
                 lora_alpha: float = 8, target_modules=("q_proj", "v_proj", "down_proj"), **lora) -> Path:
    """A peft adapter on ``base`` with random (non-zero) A and B, saved in peft's layout."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                                             init_lora_weights=False, **lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
                if adapter_dtype:
                    p.data = p.data.to(getattr(torch, adapter_dtype))
    model.save_pretrained(out)
    return out


def peft_merged(base: Path, adapter: Path) -> dict:
    """peft's merge_and_unload() of ``adapter`` into ``base`` (loaded in its own dtype): the state dict."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def assert_bit_exact(folder: Path, reference: dict) -> int:
    """Every tensor of the model folder equals the reference's bytes; returns how many."""
    from safetensors.torch import load_file

    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            ref = reference[name]
            assert t.dtype == ref.dtype and t.shape == ref.shape, name
            assert t.contiguous().view(-1).view(_int(t)).equal(ref.contiguous().view(-1).view(_int(ref))), name
            n += 1
    return n


def _int(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def varied_reward(completions: list, **kwargs) -> list[float]:
    """A reward that varies within a group (character count mod 3), so GRPO has advantages to learn from."""
    from posttrain.rewards import completion_text

    return [float(len(completion_text(c)) % 3) for c in completions]
