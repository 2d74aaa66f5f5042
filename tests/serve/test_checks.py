"""What an engine checks before another process sees a folder, and the request/switch gate."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from posttrain.chain.errors import FormatError
from posttrain.serve.checks import Gate, check_layout, folder_layout, same_weights, ties_embeddings
from tests.support.tensors import save_torch_checkpoint


def _checkpoint(path, **tensors):
    save_torch_checkpoint(path, tensors)
    return path


def test_a_folder_that_fits_passes_and_every_misfit_is_named(tmp_path):
    served = _checkpoint(tmp_path / "served", a=torch.zeros(2, 3), b=torch.zeros(4), c=torch.zeros(1))
    layout = folder_layout(served)
    check_layout(_checkpoint(tmp_path / "same", a=torch.ones(2, 3), b=torch.ones(4), c=torch.ones(1)), layout)

    bad = _checkpoint(tmp_path / "bad", a=torch.zeros(3, 2), b=torch.zeros(4, dtype=torch.float16),
                      extra=torch.zeros(1))
    with pytest.raises(ValueError) as info:
        check_layout(bad, layout)
    message = str(info.value)
    assert str(bad) in message
    assert "tensor 'a' is F32[3, 2], the served model's is F32[2, 3]" in message
    assert "tensor 'b' is F16[4]" in message
    assert "tensor 'c' is missing" in message
    assert "tensor 'extra' is not in the served model" in message


def test_a_truncated_shard_is_named(tmp_path):
    served = _checkpoint(tmp_path / "served", a=torch.zeros(64))
    layout = folder_layout(served)
    broken = _checkpoint(tmp_path / "broken", a=torch.zeros(64))
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(FormatError, match="model.safetensors"):
        check_layout(broken, layout)


def test_tied_embeddings_are_read_from_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert ties_embeddings(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": False}}))
    assert not ties_embeddings(tmp_path)


def test_a_switch_waits_for_requests_in_flight_and_holds_new_ones_back():
    gate = Gate()
    events: list[str] = []
    in_flight = threading.Event()

    def request(name: str, hold: float) -> None:
        with gate.shared():
            events.append(f"{name} start")
            in_flight.set()
            time.sleep(hold)
            events.append(f"{name} end")

    first = threading.Thread(target=request, args=("r1", 0.3))
    first.start()
    in_flight.wait()

    def switch() -> None:
        with gate.exclusive():
            events.append("switch")
            time.sleep(0.2)
            events.append("switched")

    switcher = threading.Thread(target=switch)
    switcher.start()
    time.sleep(0.1)  # the switch is waiting for r1: a request arriving now must wait for the switch
    second = threading.Thread(target=request, args=("r2", 0.0))
    second.start()
    for t in (first, switcher, second):
        t.join(5)
    assert events == ["r1 start", "r1 end", "switch", "switched", "r2 start", "r2 end"]


def test_same_weights_compares_bytes_however_sharded(tmp_path):
    a = _checkpoint(tmp_path / "a", x=torch.arange(6.0), y=torch.ones(3))
    sharded = tmp_path / "sharded"
    save_torch_checkpoint(sharded, {"x": torch.arange(6.0), "y": torch.ones(3)}, shards=2)
    assert same_weights(a, sharded)
    other = _checkpoint(tmp_path / "other", x=torch.arange(6.0), y=torch.tensor([1.0, 1.0, 1.0 + 2**-20]))
    assert not same_weights(a, other)
    assert not same_weights(a, _checkpoint(tmp_path / "fewer", x=torch.arange(6.0)))
