"""FakeSGLang answers each route as docs/sglang-http-api.md says SGLang does."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from posttrain.testing.fake_sglang import FLUSH_OK, FakeSGLang, safetensors_shapes


def _weights(folder: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    folder.mkdir(parents=True)
    save_file({n: np.zeros(s, dtype=np.float32) for n, s in shapes.items()}, str(folder / "model.safetensors"))
    return folder


SHAPES = {"embed.weight": (8, 4), "lm_head.weight": (8, 4)}


def _call(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, raw, ctype = err.code, err.read(), err.headers.get("Content-Type", "")
    if "json" in ctype:
        return status, json.loads(raw)
    return status, raw


@pytest.fixture
def fake(tmp_path: Path):
    with FakeSGLang(_weights(tmp_path / "v0", SHAPES), weight_version="v0") as server:
        yield server


def test_health_and_model_info(fake: FakeSGLang) -> None:
    assert _call(fake.url + "/health") == (200, b"")
    assert _call(fake.url + "/health_generate") == (200, b"")
    fake.set_healthy(False)
    assert _call(fake.url + "/health") == (503, b"")
    status, info = _call(fake.url + "/get_model_info")
    assert status == 200
    assert info["model_path"] == fake.model_path and info["weight_version"] == "v0"
    assert info["is_generation"] is True and "tokenizer_path" in info
    assert _call(fake.url + "/get_weight_version") == (200, {"weight_version": "v0"})


def test_update_weight_version(fake: FakeSGLang) -> None:
    status, body = _call(fake.url + "/update_weight_version", "POST", {"new_version": "v7"})
    assert (status, body) == (200, {"success": True, "message": "Weight version updated to v7", "new_version": "v7"})
    assert _call(fake.url + "/get_weight_version")[1] == {"weight_version": "v7"}
    status, body = _call(fake.url + "/update_weight_version", "POST", {})
    assert status == 400 and body["object"] == "error"


def test_update_weights_success_sets_path_and_version(fake: FakeSGLang, tmp_path: Path) -> None:
    new = _weights(tmp_path / "v1", SHAPES)
    status, body = _call(fake.url + "/update_weights_from_disk", "POST", {"model_path": str(new), "weight_version": "v1"})
    assert status == 200
    assert body == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to v1.",
        "num_paused_requests": 0,
    }
    assert _call(fake.url + "/get_model_info")[1]["model_path"] == str(new)
    assert _call(fake.url + "/get_weight_version")[1] == {"weight_version": "v1"}
    # without weight_version, the version stays
    again = _weights(tmp_path / "v2", SHAPES)
    body = _call(fake.url + "/update_weights_from_disk", "POST", {"model_path": str(again)})[1]
    assert body["message"] == "Succeeded to update model weights." and fake.weight_version == "v1"


@pytest.mark.parametrize(
    ("make", "prefix"),
    [
        (lambda tmp: tmp / "missing", "Failed to get weights iterator: "),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "Failed to get weights iterator: Cannot find"),
        (lambda tmp: _weights(tmp / "shape", {"embed.weight": (9, 4), "lm_head.weight": (8, 4)}),
         "Failed to update weights: size mismatch for embed.weight"),
        (lambda tmp: _weights(tmp / "name", {"other.weight": (8, 4)}), "Failed to update weights: 'other.weight'"),
    ],
    ids=["missing-folder", "no-safetensors", "shape-mismatch", "unknown-tensor"],
)
def test_update_weights_failure_keeps_old_weights(fake: FakeSGLang, tmp_path: Path, make, prefix: str) -> None:
    before = fake.model_path
    path = make(tmp_path)
    status, body = _call(fake.url + "/update_weights_from_disk", "POST", {"model_path": str(path), "weight_version": "bad"})
    assert status == 400
    assert body["success"] is False and body["num_paused_requests"] == 0
    assert body["message"].startswith(prefix)
    if prefix.startswith("Failed to update weights"):
        assert body["message"].endswith("\nRolling back to original weights.")
    assert fake.model_path == before and fake.weight_version == "v0"
    assert _call(fake.url + "/get_weight_version")[1] == {"weight_version": "v0"}


def test_update_weights_requires_model_path(fake: FakeSGLang) -> None:
    status, body = _call(fake.url + "/update_weights_from_disk", "POST", {})
    assert status == 400 and body["code"] == 400


def test_generate_shape_and_version_dependence(fake: FakeSGLang, tmp_path: Path) -> None:
    req = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, "return_logprob": True}
    status, out = _call(fake.url + "/generate", "POST", req)
    assert status == 200
    assert len(out["output_ids"]) == 4 and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert meta["weight_version"] == "v0" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    assert [t for _, t, _ in meta["input_token_logprobs"]] == [1, 2, 3]
    assert _call(fake.url + "/generate", "POST", req)[1]["output_ids"] == out["output_ids"]  # deterministic
    _call(fake.url + "/update_weights_from_disk", "POST", {"model_path": str(_weights(tmp_path / "v1", SHAPES)),
                                                           "weight_version": "v1"})
    after = _call(fake.url + "/generate", "POST", req)[1]
    assert after["meta_info"]["weight_version"] == "v1" and after["output_ids"] != out["output_ids"]
    batch = _call(fake.url + "/generate", "POST", {**req, "input_ids": [[1], [2]]})[1]
    assert isinstance(batch, list) and len(batch) == 2
    no_lp = _call(fake.url + "/generate", "POST", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})[1]
    assert "output_token_logprobs" not in no_lp["meta_info"]


def test_pause_modes_and_continue(fake: FakeSGLang) -> None:
    for mode in ("abort", "retract", "in_place"):
        status, body = _call(fake.url + "/pause_generation", "POST", {"mode": mode})
        assert (status, body) == (200, {"message": "Generation paused successfully.", "status": "ok"})
        assert fake.paused
    assert _call(fake.url + "/continue_generation", "POST", {}) == (
        200, {"message": "Generation continued successfully.", "status": "ok"})
    assert not fake.paused
    assert _call(fake.url + "/pause_generation", "POST", {"mode": "later"})[0] == 400
    assert _call(fake.url + "/pause_generation", "POST", {})[0] == 200  # mode defaults to abort


def _generate_in_thread(fake: FakeSGLang) -> tuple[threading.Thread, list]:
    result: list = []
    req = {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}
    thread = threading.Thread(target=lambda: result.append(_call(fake.url + "/generate", "POST", req)))
    thread.start()
    deadline = time.monotonic() + 5
    while fake.held == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread, result


def test_generate_waits_while_paused_and_flush_refused_in_place(fake: FakeSGLang) -> None:
    _call(fake.url + "/pause_generation", "POST", {"mode": "in_place"})
    thread, result = _generate_in_thread(fake)
    assert fake.held == 1 and not result
    assert _call(fake.url + "/flush_cache", "POST") == (400, FLUSH_OK.encode())
    _call(fake.url + "/continue_generation", "POST", {})
    thread.join(5)
    status, out = result[0]
    assert status == 200 and len(out["output_ids"]) == 2
    assert _call(fake.url + "/flush_cache") == (200, FLUSH_OK.encode())


def test_pause_abort_aborts_waiting_requests(fake: FakeSGLang) -> None:
    _call(fake.url + "/pause_generation", "POST", {"mode": "retract"})
    thread, result = _generate_in_thread(fake)
    _call(fake.url + "/pause_generation", "POST", {"mode": "abort"})
    thread.join(5)
    status, out = result[0]
    assert status == 200 and out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "abort"


def test_hooks_fail_next_log_and_die(fake: FakeSGLang) -> None:
    fake.fail_next("/update_weights_from_disk", 500, {"error": "boom"})
    assert _call(fake.url + "/update_weights_from_disk", "POST", {"model_path": "x"}) == (500, {"error": "boom"})
    assert _call(fake.url + "/get_weight_version")[0] == 200
    assert [(r.method, r.path) for r in fake.requests] == [
        ("POST", "/update_weights_from_disk"), ("GET", "/get_weight_version")]
    assert fake.requests[0].body == {"model_path": "x"}
    assert _call(fake.url + "/nope")[0] == 404
    url = fake.url
    fake.die()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/health", timeout=2)


def test_safetensors_shapes(tmp_path: Path) -> None:
    assert safetensors_shapes(_weights(tmp_path / "w", SHAPES)) == {n: list(s) for n, s in SHAPES.items()}


def test_a_batch_takes_one_sampling_params_per_prompt(fake: FakeSGLang) -> None:
    body = {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3}]}
    status, outs = _call(fake.url + "/generate", "POST", body)
    assert status == 200 and [len(o["output_ids"]) for o in outs] == [1, 3]
    status, err = _call(fake.url + "/generate", "POST", {**body, "sampling_params": [{}]})
    assert status == 400 and "does not match the batch size" in err["error"]["message"]


def test_die_also_drops_open_keep_alive_connections(fake: FakeSGLang) -> None:
    import requests

    with requests.Session() as session:
        assert session.get(fake.url + "/get_model_info", timeout=5).status_code == 200
        fake.die()
        with pytest.raises(requests.ConnectionError):
            session.get(fake.url + "/get_model_info", timeout=5)
