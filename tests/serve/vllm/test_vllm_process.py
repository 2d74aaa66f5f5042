"""VLLMClient and VLLMProcess against a REAL vLLM server (CPU build, from .venv-vllm).

One vLLM process serves the module (startup is ~30 s on 2 cores); the tests run in file order
and each leaves it serving model A. The model is tiny, untied and float32 (vLLM's CPU attention
needs head_dim >= 32; tied embeddings reload wrongly on CPU), so vLLM's greedy tokens equal
transformers' and logprobs agree within 1e-5.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from posttrain.serve.engine import EngineCallError
from posttrain.serve.vllm import EngineStartError, VLLMProcess, VLLMProcessConfig
from posttrain.serve.vllm.process import group_pids
from tests.support.vllm import (
    MAX_TOKENS,
    PROMPTS,
    Greedy,
    assert_matches,
    perturbed,
    require_vllm,
    transformers_greedy,
    vllm_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

require_vllm()
NAME = "tiny"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    a = vllm_model(root / "a")
    return {"a": a, "b": perturbed(a, root / "b", seed=1)}


@pytest.fixture(scope="module")
def refs(models: dict[str, Path]) -> dict[str, Greedy]:
    out = {k: transformers_greedy(v) for k, v in models.items()}
    assert out["a"] != out["b"], "the perturbation must change the greedy outputs"
    return out


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    log_file = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    proc = VLLMProcess(VLLMProcessConfig(served_model_name=NAME, log_file=log_file))
    t0 = time.monotonic()
    proc.start(models["a"])
    print(f"vLLM start: {time.monotonic() - t0:.1f} s")
    with proc:
        yield proc


def _greedy(engine: VLLMProcess) -> Greedy:
    out = []
    with engine.client(timeout=120) as client:
        for prompt in PROMPTS:
            body = {
                "model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0, "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True,
            }  # fmt: skip
            choice = client.complete(body)["choices"][0]
            named = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
            assert named == choice["token_ids"]
            out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def _reload(engine: VLLMProcess, folder: Path) -> None:
    with engine.client() as client:
        client.pause()
        try:
            client.reload(folder)
        finally:
            client.resume()


def test_completion_matches_transformers(engine: VLLMProcess, refs: dict[str, Greedy]) -> None:
    assert engine.alive()
    assert engine.url.startswith("http://127.0.0.1:")
    with engine.client() as client:
        assert client.health()
        assert client.served_models() == [NAME]
        with pytest.raises(EngineCallError) as err:
            client.complete({"model": "no-such-model", "prompt": [1], "max_tokens": 1})
        assert err.value.status == 404 and "no-such-model" in err.value.message
    assert_matches(_greedy(engine), refs["a"])


def test_reload_in_place_serves_the_new_weights(
    engine: VLLMProcess, models: dict[str, Path], refs: dict[str, Greedy]
) -> None:
    pids = engine.pids()
    _reload(engine, models["b"])
    assert_matches(_greedy(engine), refs["b"])
    _reload(engine, models["a"])
    assert_matches(_greedy(engine), refs["a"])
    assert engine.pids() == pids, "a reload happens in place, in the same processes"


def test_failed_reload_breaks_the_engine_until_restart(
    engine: VLLMProcess, models: dict[str, Path], refs: dict[str, Greedy], tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    client = engine.client(timeout=60)
    client.pause()
    with pytest.raises(EngineCallError) as err:
        client.reload(missing)
    # vLLM takes a path that is not a folder for a Hub repo id, and redacts it as '<path>'.
    assert err.value.status == 500 and "collective_rpc" in err.value.message and "Worker failed" in err.value.message
    # What it leaves: vLLM looks healthy (/health 200, same processes, /resume works) ...
    pids = engine.pids()
    assert client.health() and engine.alive() and len(pids) >= 3
    client.resume()
    # ... but its weights are gone (meta tensors): the next generate request fails and kills the engine.
    with pytest.raises(EngineCallError) as err:
        client.complete({"model": NAME, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
    assert err.value.status == 500 and "EngineCore" in err.value.message
    t0 = time.monotonic()
    while engine.pids() and time.monotonic() < t0 + 30:
        time.sleep(0.1)
    print(f"after the failed reload and one request: no vLLM process left after {time.monotonic() - t0:.1f} s")
    assert engine.pids() == [] and not engine.alive() and not client.health()
    client.close()
    t0 = time.monotonic()
    engine.restart(models["a"])
    print(f"restart after a failed reload: {time.monotonic() - t0:.1f} s")
    assert engine.alive() and engine.model_dir == models["a"].resolve()
    assert_matches(_greedy(engine), refs["a"])


def test_stop_leaves_no_process(engine: VLLMProcess) -> None:
    pids = engine.pids()
    pgid = pids and os.getpgid(pids[0])
    assert pids and pgid
    t0 = time.monotonic()
    engine.stop()
    print(f"stop: {time.monotonic() - t0:.1f} s")
    assert engine.pids() == [] and group_pids(pgid) == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    assert not engine.alive()
    with engine.client(timeout=5) as client:
        assert not client.health()


def test_start_fails_on_a_model_vllm_cannot_run(tmp_path: Path) -> None:
    """head_dim 16 (the tiny model's default size) passes /health, then dies on the first token."""
    from posttrain.models.tiny import build_tiny_model

    bad = build_tiny_model(tmp_path / "head-dim-16", seed=0)
    proc = VLLMProcess(VLLMProcessConfig(served_model_name=NAME, log_file=tmp_path / "vllm.log"))
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as err:
        proc.start(bad)
    print(f"start on an unrunnable model failed in {time.monotonic() - t0:.1f} s: {str(err.value).splitlines()[0]}")
    assert "cannot generate" in str(err.value) and err.value.log_tail
    assert "Unsupported CPU attention configuration: head_dim=16" in str(err.value), "the cause, from vLLM's log"
    assert proc.pids() == [] and not proc.alive()
