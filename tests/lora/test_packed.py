"""An adapter published alone: packed into a folder the chain carries, unpacked back bit for bit,
and refused (one line naming the file or field, nothing packed or loaded) when it cannot be served."""

from __future__ import annotations

import json

import pytest

from posttrain.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BaseRef, LoraError, base_fingerprint, write_base_ref
from posttrain.lora.packed import BASE_KEY, is_packed_adapter, pack_adapter, unpack_adapter
from posttrain.serve.adapters import BaseCheck, EngineAdapterError, unpacked
from tests.support.lora import make_adapter, make_base


def _adapter(base, out, **kw):
    make_adapter(base, out, **kw)
    write_base_ref(out, BaseRef(path=str(base), fingerprint=base_fingerprint(base)))
    return out


def test_pack_then_unpack_gives_the_same_adapter(tmp_path):
    base = make_base(tmp_path / "base")
    adapter = _adapter(base, tmp_path / "checkpoint-3")
    packed = tmp_path / "packed"
    pack_adapter(adapter, packed)
    assert is_packed_adapter(packed) and not is_packed_adapter(base)
    config = json.loads((packed / "config.json").read_text())
    assert config[BASE_KEY] == {"path": str(base), "fingerprint": base_fingerprint(base)}
    assert (packed / "model.safetensors").read_bytes() == (adapter / ADAPTER_WEIGHTS).read_bytes()

    got, ref = unpack_adapter(packed, tmp_path / "peft")
    assert ref.fingerprint == base_fingerprint(base) and got.base == ref
    assert (tmp_path / "peft" / ADAPTER_WEIGHTS).read_bytes() == (adapter / ADAPTER_WEIGHTS).read_bytes()
    assert json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text()) == json.loads((adapter / ADAPTER_CONFIG).read_text())


def test_pack_refuses_an_adapter_without_its_base_and_leaves_nothing(tmp_path):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "a")  # no posttrain.lora-base.json
    with pytest.raises(LoraError, match="no posttrain.lora-base.json") as err:
        pack_adapter(adapter, tmp_path / "packed")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "packed").exists() and not list(tmp_path.glob(".*packed*"))


def test_engine_checks_refuse_a_rank_over_the_limit_and_another_base(tmp_path):
    base = make_base(tmp_path / "base")
    pack_adapter(_adapter(base, tmp_path / "a", r=32), tmp_path / "packed")
    with pytest.raises(EngineAdapterError, match=r"r=32 .* over the engine's max LoRA rank 16 \(--engine-max-lora-rank\)"):
        unpacked(tmp_path / "packed", "step-1", max_rank=16)
    assert not (tmp_path / "packed" / "peft").exists()

    _, ref = unpacked(tmp_path / "packed", "step-1", max_rank=32)
    BaseCheck(base).check(ref, base, "step-1")  # its own base: fine
    foreign = BaseRef(path="/elsewhere", fingerprint="0" * 32)
    with pytest.raises(EngineAdapterError, match="adapter step-1 was trained on base /elsewhere") as err:
        BaseCheck(base).check(foreign, base, "step-1")
    assert "lora_publish: merged" in str(err.value) and "\n" not in str(err.value)


def test_flow_pack_task_refuses_an_adapter_of_another_base_and_publishes_nothing(tmp_path):
    from posttrain.pipeline.parameters import from_parameters
    from posttrain.pipeline.settings import NightlySettings
    from posttrain.pipeline.tasks.publishing import pack_lora

    base, other = make_base(tmp_path / "base"), make_base(tmp_path / "other", hidden_size=128)
    adapter = _adapter(other, tmp_path / "checkpoint-1")
    settings = from_parameters(NightlySettings, dict(
        run_name="lora-bad", base_model=str(base), dataset="/d.jsonl", shared_dir=str(tmp_path / "shared"),
        reward_funcs=["posttrain.rewards:format_reward"], max_steps=1, use_lora=True, lora_publish="adapter"))
    with pytest.raises(LoraError) as err:
        pack_lora.fn(str(adapter), 1, settings)
    message = str(err.value)
    assert "\n" not in message and str(other) in message and str(base) in message and "base_model" in message
    packed = settings.run_dir / "packed"
    assert not packed.exists() or not any(packed.iterdir())
    assert pack_lora.fn(str(_adapter(base, tmp_path / "checkpoint-2")), 2, settings).endswith("checkpoint-2")


def test_the_reference_server_refuses_an_adapter_naming_lora_publish(chain, store_copy, make_server, make_client,
                                                                     tmp_path):
    from posttrain.chain.writer import ChainWriter
    from posttrain.inference.contract import HotLoadFailed
    from tests.support.serving import PREFIX, Api

    base = chain.models[0]
    pack_adapter(_adapter(base, tmp_path / "a"), tmp_path / "packed")
    snap = ChainWriter(store_copy / PREFIX, run="r1").add(tmp_path / "packed", step=9)
    server = make_server(store=store_copy)
    before = Api(server.url).greedy()
    with pytest.raises(HotLoadFailed, match="lora_publish: adapter"):
        make_client(server, fallback_to_full=False).hot_load(snap.identity)
    assert Api(server.url).greedy() == before
