"""The streamed merge against peft's merge_and_unload(): bit-exact, and bad inputs refused."""

from __future__ import annotations

import json

import pytest

from posttrain.lora import LoraError, base_fingerprint, read_adapter, write_base_ref
from posttrain.lora.adapter import BaseRef
from posttrain.lora.merge import merge_adapter
from tests.support.lora import assert_bit_exact, make_adapter, make_base, peft_merged


@pytest.mark.parametrize("dtype,adapter_dtype", [("float32", None), ("bfloat16", None), ("float16", None),
                                                 ("bfloat16", "bfloat16"), ("float32", "float16")])
def test_bit_exact_with_peft(tmp_path, dtype, adapter_dtype):
    base = make_base(tmp_path / "base", dtype)
    adapter = make_adapter(base, tmp_path / "adapter", adapter_dtype=adapter_dtype)
    result = merge_adapter(adapter, base, tmp_path / "merged")
    assert result.merged_tensors == 6  # 2 layers x (q, v, down)
    assert assert_bit_exact(result.path, peft_merged(base, adapter)) == result.total_tensors
    from safetensors.torch import load_file

    before, after = load_file(str(base / "model.safetensors")), load_file(str(result.path / "model.safetensors"))
    changed = {k for k in before if not before[k].equal(after[k])}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(2)
                       for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    assert (base / "model.safetensors").read_bytes()[:64] == (result.path / "model.safetensors").read_bytes()[:64]


def test_rslora_and_sharded_base(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    base = make_base(tmp_path / "base")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists():
            (sharded / f).write_bytes((base / f).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists()
    adapter = make_adapter(sharded, tmp_path / "adapter", use_rslora=True, target_modules=("q_proj", "gate_proj"))
    result = merge_adapter(adapter, sharded, tmp_path / "merged")
    assert assert_bit_exact(result.path, peft_merged(sharded, adapter)) == result.total_tensors
    assert (result.path / "model.safetensors.index.json").exists()


def _ref(adapter, base):
    write_base_ref(adapter, BaseRef(path=str(base), fingerprint=base_fingerprint(base)))


def test_fingerprint_is_checked(tmp_path):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter")
    _ref(adapter, base)
    other = make_base(tmp_path / "other")  # same layout, other values
    data = bytearray((other / "model.safetensors").read_bytes())
    data[-4:] = b"\x00\x00\x00\x40"  # a norm weight 1.0 -> 2.0
    (other / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(LoraError, match="was trained on base .* but .* has fingerprint"):
        merge_adapter(adapter, other, tmp_path / "merged")
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".tmp-merged-*"))
    assert merge_adapter(adapter, base, tmp_path / "merged").path.exists()


def test_bad_inputs_one_line_and_nothing_written(tmp_path):
    base = make_base(tmp_path / "base")
    out = tmp_path / "merged"
    # shape: an adapter trained on a wider model
    wide = make_base(tmp_path / "wide", hidden_size=128)
    adapter = make_adapter(wide, tmp_path / "a-wide")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match=r"down_proj' is lora_B \[128, 4\] @ lora_A \[4, 256\] = \[128, 256\], but base .* of shape \[64, 128\]"):
        merge_adapter(adapter, base, out)
    # path: an adapter of another base of the same shapes, with no fingerprint
    other = make_base(tmp_path / "other")
    with pytest.raises(LoraError, match="was trained on .*other, not on .*base"):
        merge_adapter(make_adapter(other, tmp_path / "a-other"), base, out)
    # a target module the base lacks
    adapter = make_adapter(base, tmp_path / "a-missing")
    header_fix = (adapter / "adapter_model.safetensors").read_bytes().replace(b"q_proj", b"x_proj")
    (adapter / "adapter_model.safetensors").write_bytes(header_fix)
    with pytest.raises(LoraError, match="target module 'model.layers.0.self_attn.x_proj' has no tensor"):
        merge_adapter(adapter, base, out)
    # a refused base dtype (an int8 matrix)
    from safetensors.torch import load_file, save_file

    q8 = tmp_path / "q8"
    q8.mkdir()
    tensors = load_file(str(base / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(
        __import__("torch").int8)
    save_file(tensors, str(q8 / "model.safetensors"), metadata={"format": "pt"})
    adapter = make_adapter(base, tmp_path / "a-q8")
    with pytest.raises(LoraError, match="is I8; only F32, BF16 and F16 bases"):
        merge_adapter(adapter, q8, out)
    # DoRA
    dora = make_adapter(base, tmp_path / "a-dora", use_dora=True)
    with pytest.raises(LoraError):
        read_adapter(dora)
    assert not out.exists() and not list(tmp_path.glob(".tmp-merged-*"))


def test_flow_merge_task_refuses_a_foreign_adapter_and_leaves_nothing(tmp_path):
    """The flows' merge step (``merge_lora``) on an adapter of another base: one line naming both,
    no merged folder, so ``publish_weights`` never reaches the publisher."""
    from posttrain.pipeline.parameters import from_parameters
    from posttrain.pipeline.settings import NightlySettings
    from posttrain.pipeline.tasks.publishing import merge_lora

    base, other = make_base(tmp_path / "base"), make_base(tmp_path / "other", hidden_size=128)
    adapter = make_adapter(other, tmp_path / "checkpoint-1")
    _ref(adapter, other)
    settings = from_parameters(NightlySettings, dict(
        run_name="lora-bad", base_model=str(base), dataset="/d.jsonl", shared_dir=str(tmp_path / "shared"),
        reward_funcs=["posttrain.rewards:format_reward"], max_steps=1, use_lora=True))
    with pytest.raises(LoraError) as err:
        merge_lora.fn(str(adapter), 1, settings)
    assert "\n" not in str(err.value) and "down_proj" in str(err.value) and str(base) in str(err.value)
    merged = settings.run_dir / "merged"
    assert not merged.exists() or not any(merged.iterdir())
