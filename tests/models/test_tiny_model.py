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
    assert torch.equal(out[0, : ids.shape[1]], ids[0])  # continues the prompt
    new = out[0, ids.shape[1] :].tolist()
    assert 1 <= len(new) <= 5 and all(0 <= t < len(tokenizer) for t in new)
    if len(new) < 5:  # generation stops early only at the end of the turn
        assert new[-1] == tokenizer.eos_token_id
    with torch.no_grad():
        first = int(model(ids).logits[0, -1].argmax())
    assert new[0] == first  # greedy: the most likely next token
    assert tokenizer.decode(ids[0]) == text  # byte-level BPE round-trips


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_are_the_seeds_weights_in_the_requested_dtype(tiny_model_dir, tmp_path, dtype):
    import torch
    from safetensors.torch import load_file

    weights = load_file(build_tiny_model(tmp_path / dtype, seed=0, dtype=dtype) / "model.safetensors")
    reference = load_file(tiny_model_dir / "model.safetensors")  # seed 0, float32
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == getattr(torch, dtype), name
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name


def test_tokenizer_has_specials():
    tokenizer = build_tiny_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert len(set(specials)) == 3 and all(isinstance(i, int) and 0 <= i < len(tokenizer) for i in specials)
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).input_ids
    assert ids[0] == specials[1] and ids[-1] == specials[2]  # each special is one token, never split
