"""SGLangClient reads back which weights SGLang holds (``/get_weights_by_name``, hashed by the gateway), against
FakeSGLang, whose ``/get_weights_by_name`` answers what its model holds now as SGLang's LlamaForCausalLM does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from posttrain.serve.engine import EngineCallError
from posttrain.serve.sglang import SGLangClient
from posttrain.serve.weight_digest import EMBEDDINGS, TIED_HEAD, comparable, compare, held_expected
from posttrain.testing.fake_sglang import FakeSGLang
from posttrain.testing.fake_sglang_weights import write_tiny_llama

NORM = "model.layers.0.input_layernorm.weight"  # a tensor v1 changes
FINAL_NORM = "model.norm.weight"  # one v1 leaves alone


def _variant(src: Path, dst: Path, seed: int) -> Path:
    """A copy of ``src`` with the tensors of layer 0 and the embeddings moved (the rest bit-identical)."""
    shutil.copytree(src, dst)
    (shard,) = dst.glob("*.safetensors")
    tensors = load_file(shard)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if ".layers.0." in name or name == EMBEDDINGS:
            tensors[name] = t + torch.randn(t.shape, generator=gen).to(t.dtype) * 0.25
    save_file(tensors, shard, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    v0 = write_tiny_llama(root / "v0", seed=0)
    return v0, _variant(v0, root / "v1", seed=1)


@pytest.fixture
def served(models):
    """(FakeSGLang on v0, an SGLangClient for it); both closed at the end."""
    fake = FakeSGLang(models[0]).start()
    client = SGLangClient(fake.url, model_dir=models[0])
    yield fake, client
    client.close()
    fake.stop()


def _candidates(folder: Path) -> list[str]:
    """What the gateway asks ``read_layout`` for: every checkpoint tensor, and the tied LM head."""
    from posttrain.chain.checkpoint import Checkpoint

    return [*Checkpoint.open(folder).tensors, TIED_HEAD]


def _check(client: SGLangClient, folder: Path, names: dict[str, int | None]):
    report = client.read_held(names)
    return report, compare(held_expected(folder, names, report.dtype), report.tensors, what="its parameters",
                           version=folder.name)


def test_the_boot_weights_read_back_exactly_as_held(served, models):
    fake, client = served
    v0 = models[0]
    layout = client.read_layout(_candidates(v0))
    norms = {n for n in _candidates(v0) if n.endswith("norm.weight")}
    assert set(layout) == norms | {EMBEDDINGS, TIED_HEAD}  # no fused slice, no matrix: only what is asked
    # float32 config and --dtype auto: SGLang holds float16; the vocabulary of 100 padded to 128 rows
    assert layout[EMBEDDINGS].dtype == "float16" and layout[EMBEDDINGS].shape == (128, 32)
    assert layout[FINAL_NORM].shape == (32,) and all(t.digest == "" for t in layout.values())
    names = comparable(layout, v0)
    assert names[EMBEDDINGS] == names[TIED_HEAD] == 100 and names[FINAL_NORM] is None
    report, verdict = _check(client, v0, names)
    assert verdict.ok, verdict.reason
    assert report.identity == "default" and report.dtype == "float16"
    assert all(t.finite for t in report.tensors.values())


def test_a_reload_reads_back_the_new_weights_and_its_version(served, models):
    fake, client = served
    v0, v1 = models
    names = comparable(client.read_layout(_candidates(v0)), v0)
    client.reload(v1)
    report, verdict = _check(client, v1, names)
    assert verdict.ok, verdict.reason
    assert report.identity == "v1"
    assert not _check(client, v0, names)[1].ok  # and not the old ones


def test_a_reload_that_drops_a_tensor_is_caught_naming_it(served, models):
    fake, client = served
    v0, v1 = models
    names = comparable(client.read_layout(_candidates(v0)), v0)
    fake.weights.drop_on_next_reload(NORM)
    client.reload(v1)  # SGLang reports success
    report, verdict = _check(client, v1, names)
    assert report.identity == "v1"
    assert not verdict.ok and verdict.differing == (NORM,)
    assert f"{NORM} differs" in verdict.reason


def test_a_reload_that_serves_cached_weights_is_caught(served, models):
    fake, client = served
    v0, v1 = models
    names = comparable(client.read_layout(_candidates(v0)), v0)
    fake.weights.serve_cached_on_next_reload()
    client.reload(v1)
    assert (fake.model_path, fake.weight_version) == (str(v1), "v1")  # what SGLang says it holds
    report, verdict = _check(client, v1, names)
    assert report.identity == "v1"  # the new version reported, the old values held
    changed = {NORM, "model.layers.0.post_attention_layernorm.weight", EMBEDDINGS, TIED_HEAD}
    assert not verdict.ok and set(verdict.differing) == changed
    assert _check(client, v0, names)[1].ok


def test_other_weights_behind_the_reported_version_are_caught(served, models):
    fake, client = served
    v0, v1 = models
    names = comparable(client.read_layout(_candidates(v0)), v0)
    client.reload(v1)
    fake.weights.hold(v0)  # put back on v0 by someone else: v1 is still reported
    report, verdict = _check(client, v1, names)
    assert report.identity == "v1" and not verdict.ok and NORM in verdict.differing
    assert _check(client, v0, names)[1].ok


def test_nan_is_reported_as_not_finite_and_refused(served, models):
    fake, client = served
    v0 = models[0]
    names = comparable(client.read_layout(_candidates(v0)), v0)
    fake.weights.poison(FINAL_NORM)
    report, verdict = _check(client, v0, names)
    assert report.tensors[FINAL_NORM].finite is False
    assert all(t.finite for n, t in report.tensors.items() if n != FINAL_NORM)
    assert not verdict.ok and verdict.differing == (FINAL_NORM,)
    assert "holds NaN or infinity" in verdict.reason


def test_an_explicit_dtype_is_read_from_the_server_args(models, tmp_path):
    v0 = models[0]
    with FakeSGLang(v0, dtype="bfloat16") as fake, SGLangClient(fake.url, model_dir=v0) as client:
        names = comparable(client.read_layout(_candidates(v0)), v0)
        report, verdict = _check(client, v0, names)
        assert report.dtype == "bfloat16" and verdict.ok, verdict.reason


def test_a_dtype_guessed_wrong_is_refused_not_rounded(models, tmp_path):
    """The gateway's config says bfloat16 where SGLang booted from a float32 config (so holds float16):
    float16 values that bfloat16 cannot hold are refused instead of rounded into a match."""
    v0 = models[0]
    wrong = tmp_path / "wrong"
    shutil.copytree(v0, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    with FakeSGLang(v0) as fake, SGLangClient(fake.url, model_dir=wrong) as client:
        with pytest.raises(EngineCallError, match="not all bfloat16 values"):
            client.read_held({EMBEDDINGS: 100})


def test_a_model_without_get_weights_by_name_reads_back_nothing(models, tmp_path):
    """SGLang's Qwen2ForCausalLM has no get_weights_by_name: every name fails, so nothing is comparable."""
    qwen = tmp_path / "qwen"
    shutil.copytree(models[0], qwen)
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    with FakeSGLang(qwen) as fake, SGLangClient(fake.url, model_dir=qwen) as client:
        assert client.read_layout(_candidates(qwen)) == {}
        assert client.read_held({FINAL_NORM: None}).tensors == {}  # compare then names it missing


def test_tensors_over_the_budget_and_of_unknown_size_are_not_read(models):
    v0 = models[0]
    with FakeSGLang(v0) as fake:
        with SGLangClient(fake.url, model_dir=v0, readback_max_elements=100 * 32 - 1) as client:
            assert EMBEDDINGS not in client.read_layout(_candidates(v0))  # 3,200 values
        with SGLangClient(fake.url) as client:  # no model folder: sizes unknown, only the norms
            layout = client.read_layout([EMBEDDINGS, FINAL_NORM])
        assert set(layout) == {FINAL_NORM}
        assert not [r for r in fake.requests if r.body.get("name") == EMBEDDINGS]


def test_get_weights_by_name_answers_as_sglang(models):
    """The fake's route: SGLang's request body, float32 values cut to truncate_size rows, fused slices, 400s."""
    v0 = models[0]
    stored = load_file(next(v0.glob("*.safetensors")))
    with FakeSGLang(v0, dtype="float32") as fake:
        def ask(**body):
            return requests.post(fake.url + "/get_weights_by_name", json=body, timeout=10)

        rows = ask(name=EMBEDDINGS).json()  # truncate_size defaults to 100 rows
        assert len(rows) == 100 and rows == stored[EMBEDDINGS].tolist()
        assert len(ask(name=EMBEDDINGS, truncate_size=1000).json()) == 128  # padded with zero rows
        assert ask(name=FINAL_NORM, truncate_size=3).json() == stored[FINAL_NORM][:3].tolist()
        q = "model.layers.1.self_attn.q_proj.weight"  # a slice of the fused qkv_proj: the checkpoint's
        assert ask(name=q, truncate_size=1000).json() == stored[q].tolist()
        fused = ask(name="model.layers.1.self_attn.qkv_proj.weight", truncate_size=1000).json()
        assert len(fused) == 32 + 16 + 16
        missing = ask(name="model.layers.7.input_layernorm.weight")
        assert missing.status_code == 400 and missing.json() == {"error": {"message": "Get parameter by name failed"}}
        assert ask(truncate_size=3).status_code == 400  # name is required
        info = requests.get(fake.url + "/get_server_info", timeout=10).json()
        assert info["dtype"] == "float32" and info["model_path"] == str(v0) and info["dp_size"] == 1
        fake.weights.poison(FINAL_NORM)
        assert ask(name=FINAL_NORM, truncate_size=1).json() == [None]  # orjson writes NaN as null
