"""The tiny offline model: deterministic, loadable, generates, has a working chat template."""

from __future__ import annotations

import hashlib

import pytest

from posttrain.datasets.toy import toy_prompt_rows
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(again / name) == _digest(tiny_model_dir / name)
    assert _digest(other / "model.safetensors") != _digest(tiny_model_dir / "model.safetensors")


def test_loads_and_generates_from_a_chat_prompt(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert 256 < len(tokenizer) <= 2048
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.padding_side == "left"
    text = tokenizer.apply_chat_template(toy_prompt_rows(1)[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5) or tokenizer.eos_token_id in out[0, ids.shape[1] :].tolist()
    assert tokenizer.decode(ids[0]) == text  # byte-level BPE round-trips


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bf16_weights(tmp_path, dtype):
    from safetensors import safe_open

    path = build_tiny_model(tmp_path / "bf16", seed=0, dtype=dtype)
    with safe_open(str(path / "model.safetensors"), "np" if dtype == "float32" else "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}


def test_tokenizer_has_specials():
    tokenizer = build_tiny_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") is not None
