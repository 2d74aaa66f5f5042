"""``posttrain serve --engine sglang``: the gateway in front of FakeSGLang servers (SGLang's wheels
need CUDA; the fake follows SGLang's source, docs/sglang-http-api.md)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from posttrain.inference.contract import HotLoadFailed
from posttrain.inference.protocol import API_PREFIX, STATE_COMPLETED, STATE_FAILED
from posttrain.serve.completions import RequestError
from posttrain.serve.engine import EngineCallError
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.sglang import from_generate, to_generate
from posttrain.testing.fake_sglang import FakeSGLang
from posttrain.testing.fake_sglang_model import one_output
from tests.support.serving import DEPLOYMENT, PREFIX, PROMPT, Api

SWITCH = ("/pause_generation", "/update_weights_from_disk", "/continue_generation")


@pytest.fixture
def fakes(chain):
    """fakes(n) -> n started FakeSGLang servers on the boot model; stopped at teardown."""
    started: list[FakeSGLang] = []

    def make(n: int = 1) -> list[FakeSGLang]:
        new = [FakeSGLang(chain.models[0]).start() for _ in range(n)]
        started.extend(new)
        return new

    yield make
    for f in started:
        f.stop()


@pytest.fixture
def gateway(make_server, fakes):
    """gateway(n, store=None) -> (the InferenceServer with engine sglang, its n fakes)."""

    def make(n: int = 1, store: Path | None = None):
        fs = fakes(n)
        return make_server(store=store, engine="sglang", engine_urls=[f.url for f in fs]), fs

    return make


def _calls(fake: FakeSGLang, paths=SWITCH):
    return [r for r in fake.requests if r.path in paths]


def test_full_then_deltas_reload_sglang_and_completions_carry_the_version(gateway, make_client, chain):
    server, (fake,) = gateway()
    api = Api(server.url)
    client = make_client(server)
    for identity, base in ((chain.full, None), (chain.d1, chain.full), (chain.d2, chain.d1)):
        result = client.hot_load(identity, base_identity=base)
        assert result.state == STATE_COMPLETED
        assert [(r.name, r.state, r.current_snapshot_identity) for r in result.replicas] == [
            ("sglang-0", "READY", identity)]

    calls = _calls(fake)
    assert [c.path for c in calls] == list(SWITCH) * 3  # pause before and continue after each update
    assert all(c.body == {"mode": "abort"} for c in calls if c.path == "/pause_generation")
    update = calls[-2].body
    folder = Path(update["model_path"])
    assert folder.is_dir() and folder.is_relative_to(server.work_dir)  # the rebuilt folder, not the store's
    assert update["weight_version"] == folder.name and update["flush_cache"] is True
    assert (fake.model_path, fake.weight_version) == (str(folder), folder.name)

    reply = api.complete(prompt=PROMPT, max_tokens=4, temperature=0, n=2)
    assert reply["snapshot_identity"] == chain.d2 and reply["weight_version"] == folder.name
    assert reply["object"] == "text_completion" and reply["model"] == "tiny"
    expected = one_output("", PROMPT, 4, str(folder), folder.name, True, False)["output_ids"]
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for choice in reply["choices"]:
        assert choice["token_ids"] == expected  # the fake's tokens for the loaded folder
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected]
        assert len(choice["logprobs"]["token_logprobs"]) == 4
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
        assert choice["finish_reason"] == "length" and "prompt_logprobs" not in choice
    assert reply["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 8, "total_tokens": len(PROMPT) + 8}
    generate = _calls(fake, ("/generate",))[-1].body
    assert generate["input_ids"] == [PROMPT, PROMPT]  # n copies of the prompt, one batch
    assert generate["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0}
    assert generate["return_logprob"] is True and generate["logprob_start_len"] == -1


def _write_broken(chain, store: Path, tmp_path: Path, breakage: str) -> tuple[str, str]:
    """A full snapshot of m0 with one tensor dropped or reshaped, added to ``store``'s chain."""
    from safetensors.torch import load_file, save_file

    from posttrain.chain.writer import ChainWriter

    broken = tmp_path / f"broken-{breakage}"
    shutil.copytree(chain.models[0], broken)
    (shard,) = broken.glob("*.safetensors")
    tensors = load_file(shard)
    name = sorted(n for n in tensors if ".layers.0." in n)[0]
    if breakage == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name].flatten()[:-1].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    result = ChainWriter(store / PREFIX, run="r1").add(broken, step=9)
    assert result.kind == "full"
    return result.identity, name


@pytest.mark.parametrize("breakage", ["missing", "shape"])
def test_a_folder_that_does_not_fit_never_reaches_sglang(gateway, make_client, chain, store_copy, tmp_path, breakage):
    identity, tensor = _write_broken(chain, store_copy, tmp_path, breakage)
    server, (fake,) = gateway(store=store_copy)
    api = Api(server.url)
    client = make_client(server, fallback_to_full=False)
    client.hot_load(chain.full)
    before = len(_calls(fake))
    with pytest.raises(HotLoadFailed) as info:
        client.hot_load(identity)
    assert tensor in str(info.value)
    op = api.get(f"{API_PREFIX}/{info.value.operation_id}").json()["hotLoad"]
    assert op["status"]["state"] == STATE_FAILED and tensor in op["status"]["conditions"][0]["message"]
    assert len(_calls(fake)) == before  # no pause, no update: SGLang never saw the folder
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == chain.full


def test_sglang_refusing_an_update_fails_the_hot_load_and_the_old_version_serves(gateway, make_client, chain):
    server, (fake,) = gateway()
    api = Api(server.url)
    client = make_client(server, fallback_to_full=False)
    client.hot_load(chain.full)
    served = fake.model_path
    fake.fail_next("/update_weights_from_disk", 400, {
        "success": False, "message": "Failed to update weights: boom.\nRolling back to original weights.",
        "num_paused_requests": 0})
    with pytest.raises(HotLoadFailed) as info:
        client.hot_load(chain.d1, base_identity=chain.full)
    assert "Failed to update weights: boom." in str(info.value)
    assert api.get(f"{API_PREFIX}/{info.value.operation_id}").json()["hotLoad"]["status"]["state"] == STATE_FAILED
    assert fake.model_path == served and not fake.paused  # put back on the previous folder, generating
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == chain.full

    assert client.hot_load(chain.d1, base_identity=chain.full).state == STATE_COMPLETED
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == chain.d1


def test_a_dead_sglang_is_reported_error_and_the_other_replica_serves(gateway, make_client, chain):
    server, fakes = gateway(2)
    api = Api(server.url)
    client = make_client(server, fallback_to_full=False)
    op_id = client.hot_load(chain.full).operation_id
    assert all(len(_calls(f)) == 3 for f in fakes)  # both replicas switched
    fakes[1].die()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        states = {r["name"]: r for r in api.get(f"{API_PREFIX}/{op_id}/replicas").json()["replicas"]}
        if states["sglang-1"]["state"] == "ERROR":
            break
        time.sleep(0.2)
    assert states["sglang-0"]["state"] == "READY"
    assert states["sglang-1"]["state"] == "ERROR" and "health probe" in states["sglang-1"]["errorReason"]
    for _ in range(3):  # requests go to the replica that answers
        assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == chain.full
    with pytest.raises(HotLoadFailed) as info:
        client.hot_load(chain.d1, base_identity=chain.full)
    assert "sglang-1" in str(info.value)


# ---------------------------------------------------------------- translation and configuration

def test_seed_and_several_prompts_give_one_seed_per_row_and_prompt_logprobs():
    body = {"model": "tiny", "prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2, "seed": 7, "prompt_logprobs": 1,
            "logprobs": 1}
    params, generate = to_generate(body)
    assert generate["input_ids"] == [[1, 2], [1, 2], [3], [3]] and generate["logprob_start_len"] == 0
    assert [p["sampling_seed"] for p in generate["sampling_params"]] == [7, 8, 9, 10]
    outs = [one_output(str(i), p, 2, "/w", "v1", True, False) for i, p in enumerate(generate["input_ids"])]
    reply = from_generate(params, outs, model="tiny", prompt_logprobs=True)
    assert [c["prompt_index"] for c in reply["choices"]] == [0, 0, 1, 1]
    assert reply["choices"][0]["prompt_logprobs"] == [None, {"2": {"logprob": -1.0}}]
    assert reply["weight_version"] == "v1"


def test_bad_bodies_and_aborted_requests_are_clear_errors():
    with pytest.raises(RequestError, match="stop is not supported"):
        to_generate({"model": "tiny", "prompt": [1], "stop": ["x"]})
    with pytest.raises(RequestError, match="prompt_logprobs must be 0 or 1"):
        to_generate({"model": "tiny", "prompt": [1], "prompt_logprobs": 5})
    params, _ = to_generate({"model": "tiny", "prompt": [1]})
    aborted = one_output("r", [1], 2, "/w", "v", True, aborted=True)
    with pytest.raises(EngineCallError, match="SGLang aborted the request") as info:
        from_generate(params, [aborted], model="tiny", prompt_logprobs=False)
    assert info.value.status == 503


def test_sglang_needs_engine_urls(chain, tmp_path):
    fields = dict(model_dir=chain.models[0], deployment_id=DEPLOYMENT, store=str(tmp_path), token=SecretStr("t"),
                  engine="sglang")
    with pytest.raises(ValidationError, match="engine_urls"):
        ServeConfig(**fields)
    with pytest.raises(ValidationError, match="reload restart"):
        ServeConfig(**fields, engine_urls=["http://127.0.0.1:1"], reload="restart")


def test_an_sglang_that_does_not_answer_at_start_is_named(make_server):
    with pytest.raises(ValueError, match=r"engine_urls\[0\] http://127.0.0.1:9: SGLang does not answer"):
        make_server(engine="sglang", engine_urls=["http://127.0.0.1:9"])


def test_a_corrupt_byte_the_delta_inherits_never_reaches_sglang(gateway, make_client, chain, store_copy):
    """The shared hot-load path (fetch, rebuild) checks every byte for the gateway too: a byte of the
    full snapshot in a tensor d1 leaves alone would flow into d1's rebuild unchecked otherwise."""
    from posttrain.chain.safetensors_io import read_header

    shard = next((store_copy / PREFIX / chain.full).glob("*.safetensors"))
    info = next(t for t in read_header(shard).tensors.values() if ".layers.0." not in t.name and t.nbytes)
    data = bytearray(shard.read_bytes())
    data[info.offset] ^= 0x01
    shard.write_bytes(bytes(data))
    server, (fake,) = gateway(store=store_copy)
    api = Api(server.url)
    client = make_client(server, fallback_to_full=False)
    with pytest.raises(HotLoadFailed) as info_:
        client.hot_load(chain.d1, base_identity=chain.full)
    message = api.get(f"{API_PREFIX}/{info_.value.operation_id}").json()["hotLoad"]["status"]["conditions"][0]["message"]
    assert f"snapshot {chain.full}: file {shard.name}" in message and repr(info.name) in message
    assert not _calls(fake)  # SGLang never saw a folder
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] is None  # the boot weights serve


# ---------------------------------------------------------------- weights read back (issue 34)

NORM = "model.norm.weight"
EMBEDDINGS = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (SGLang's LlamaForCausalLM answers /get_weights_by_name; its Qwen2 class does not) and the
    same model after one AdamW step at lr 1e-6, as a full snapshot and a delta."""
    from posttrain.chain.policy import ChainPolicy
    from posttrain.chain.writer import ChainWriter
    from posttrain.testing.fake_sglang_weights import write_tiny_llama
    from tests.support.updates import one_update

    root = tmp_path_factory.mktemp("llama-chain")
    m0 = write_tiny_llama(root / "m0")
    m1 = one_update(m0, root / "m1", lr=1e-6)
    writer = ChainWriter(root / "store" / PREFIX, run="r", policy=ChainPolicy(delta_budget=100.0))
    snaps = [writer.add(m0, step=0), writer.add(m1, base=m0, step=1)]
    assert [s.kind for s in snaps] == ["full", "delta"]
    return {"models": [m0, m1], "ids": [s.identity for s in snaps], "store": root / "store", "writer": writer,
            "root": root}


@pytest.fixture
def llama_fake(llama):
    """A FakeSGLang on the tiny Llama, at SGLang's default --dtype auto (float16 here); stopped after the gateway."""
    fake = FakeSGLang(llama["models"][0]).start()
    yield fake
    fake.stop()


@pytest.fixture
def read_back(llama_fake, make_server, llama):
    """(a gateway over ``llama_fake``, probing every 0.3 s; the fake)."""
    server = make_server(store=llama["store"], model_dir=llama["models"][0], engine="sglang",
                         engine_urls=[llama_fake.url], probe_interval_s=0.3)
    return server, llama_fake


def _served_identity(server) -> str | None:
    return Api(server.url).complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"]


@pytest.mark.parametrize("fault", ["cached", "drop"])
def test_a_switch_that_leaves_sglang_on_the_previous_version_is_refused(read_back, make_client, llama, fault):
    server, fake = read_back
    replica = server.engine.replicas[0]
    assert EMBEDDINGS in replica.readback and NORM in replica.readback  # learnt from SGLang at start
    loader = make_client(server, fallback_to_full=False)
    loader.hot_load(llama["ids"][0])
    if fault == "cached":
        fake.weights.serve_cached_on_next_reload()  # reports the new version, holds every old value
    else:
        fake.weights.drop_on_next_reload(EMBEDDINGS)
    with pytest.raises(HotLoadFailed) as info:
        loader.hot_load(llama["ids"][1], base_identity=llama["ids"][0])
    assert "its parameters (float16)" in str(info.value) and f"{EMBEDDINGS} differs" in str(info.value)
    assert _served_identity(server) == llama["ids"][0]  # put back on the served version
    assert not server.engine.replica_errors()
    assert loader.hot_load(llama["ids"][1], base_identity=llama["ids"][0]).identity == llama["ids"][1]
    report = replica.client.read_held(replica.readback)
    assert report.identity == fake.weight_version == Path(fake.model_path).name


@pytest.mark.parametrize("fault", ["previous", "nan"])
def test_the_monitor_finds_sglang_on_other_weights_and_puts_it_back(read_back, make_client, llama, fault, caplog):
    import logging

    server, fake = read_back
    loader = make_client(server, fallback_to_full=False)
    loader.hot_load(llama["ids"][0])
    loader.hot_load(llama["ids"][1], base_identity=llama["ids"][0])
    served = fake.model_path
    caplog.set_level(logging.INFO, logger="posttrain.serve.holding")
    if fault == "previous":  # behind the gateway's back, on N-1, while SGLang still reports N
        fake.weights.hold(llama["models"][0])
    else:
        fake.weights.poison(NORM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any("is back on" in r.getMessage() for r in caplog.records):
        time.sleep(0.1)
    records = [r.getMessage() for r in caplog.records if r.name == "posttrain.serve.holding"]
    found = [r for r in records if "putting it back" in r]
    assert found, records
    assert (f"{NORM} holds NaN or infinity" if fault == "nan" else f"{EMBEDDINGS} differs") in found[0], found
    assert any("is back on" in r for r in records), records
    assert fake.weights.folder == Path(served) and not fake.weights.kept  # reloaded: the served weights again
    assert _served_identity(server) == llama["ids"][1] and not server.engine.replica_errors()


def test_a_snapshot_with_nan_never_serves_on_sglang(read_back, make_client, llama):
    from tests.support.updates import nan_weights

    server, fake = read_back
    loader = make_client(server, fallback_to_full=False)
    loader.hot_load(llama["ids"][0])
    loader.hot_load(llama["ids"][1], base_identity=llama["ids"][0])
    poisoned = llama["writer"].add(nan_weights(llama["models"][1], llama["root"] / "nan", NORM), step=5)
    on = {"base_identity": llama["ids"][1]} if poisoned.kind == "delta" else {}
    with pytest.raises(HotLoadFailed, match=f"{NORM} holds NaN or infinity"):  # read back from SGLang
        loader.hot_load(poisoned.identity, **on)
    assert _served_identity(server) == llama["ids"][1]


def test_an_idle_replica_is_only_asked_health_until_its_idle_interval_and_read_back_after_it_answers(
        llama_fake, make_server, make_client, llama):
    """A readback is a request the engine's worker serves (vLLM's spins a second after each): a replica that
    answered nothing since its last one is only asked for health between readbacks idle_probe_interval_s
    apart; one that answered a request is read back at the next probe."""
    server = make_server(store=llama["store"], model_dir=llama["models"][0], engine="sglang",
                         engine_urls=[llama_fake.url], probe_interval_s=0.1, idle_probe_interval_s=3600)
    make_client(server).hot_load(llama["ids"][0])

    def count(path: str) -> int:
        return sum(r.path == path for r in llama_fake.requests)

    def probes_pass(n: int) -> None:  # n more health probes (SGLang's: GET /get_model_info)
        target, deadline = count("/get_model_info") + n, time.monotonic() + 120
        while count("/get_model_info") < target and time.monotonic() < deadline:
            time.sleep(0.05)
        assert count("/get_model_info") >= target

    before = count("/get_weights_by_name")
    probes_pass(10)
    assert count("/get_weights_by_name") == before  # idle: health only
    _served_identity(server)
    probes_pass(3)
    after = count("/get_weights_by_name")
    assert after > before  # it answered: read back at the next probe
    probes_pass(10)
    assert count("/get_weights_by_name") == after  # idle again
