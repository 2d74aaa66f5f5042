"""The gateway proves what it serves (issue 20): what a replica holds is read back from the replica
(SGLang's weight version here, against FakeSGLang), a restarted engine is put back on the served
version and never stamped with it meanwhile, a restarted gateway adopts what its replicas hold, a
damaged rebuilt folder is never resumed, one server per work dir, and long identities."""

from __future__ import annotations

import time
import uuid

import pytest
import requests

from posttrain.inference.protocol import API_PREFIX, STATE_COMPLETED, STATE_FAILED, TYPE_FULL
from posttrain.serve.server import ServeStartError
from posttrain.testing.fake_sglang import FakeSGLang
from tests.support.serving import DEPLOYMENT, FORBIDDEN, PROMPT, Api, start_server, wait_op

INTERVAL = 0.5  # the gateway's probe interval in these tests


@pytest.fixture
def running():
    """Servers and fakes started by a test, stopped at its end."""
    started: list = []
    yield started
    for s in reversed(started):
        s.shutdown() if hasattr(s, "shutdown") else s.stop()


def _gateway(chain, work, fake, running, **overrides):
    server = start_server(chain, work, engine="sglang", engine_urls=[fake.url],
                          **{"probe_interval_s": INTERVAL, **overrides})
    running.append(server)
    return server, Api(server.url)


def _fake(chain, running, port: int = 0) -> FakeSGLang:
    fake = FakeSGLang(chain.models[0], port=port).start()
    running.append(fake)
    return fake


def _create(api: Api, identity: str, kind: str = TYPE_FULL) -> dict:
    reply = api.post(API_PREFIX, json={"deploymentId": DEPLOYMENT, "identity": identity, "type": kind,
                                       "hotLoadId": str(uuid.uuid4())})
    assert reply.status_code == 200, reply.text
    return reply.json()["hotLoad"]


def _replicas(api: Api, op_id: str) -> list[dict]:
    return api.get(f"{API_PREFIX}/{op_id}/replicas").json()["replicas"]


def test_an_engine_restarted_on_its_launch_weights_is_never_stamped_and_is_put_back(chain, tmp_path, running,
                                                                                  make_client):
    fake = _fake(chain, running)
    server, api = _gateway(chain, tmp_path / "work", fake, running)
    make_client(server).hot_load(chain.full)
    op = _create(api, chain.full)  # a second operation, to read replicas through
    folder, version = fake.model_path, fake.weight_version
    assert api.complete(prompt=PROMPT, max_tokens=2)["weight_version"] == version

    port = int(fake.url.rsplit(":", 1)[1])
    fake.die()
    restarted = _fake(chain, running, port)  # whoever runs SGLang restarted it: launch weights, "default"
    t_restart = time.monotonic()
    assert restarted.weight_version == "default"
    stamped = []
    while time.monotonic() - t_restart < 4 * INTERVAL + 2:
        reply = requests.post(f"{server.url}/v1/completions", headers=api.headers,
                              json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=10)
        assert reply.status_code in (200, 503), reply.text
        if reply.status_code == 200:
            body = reply.json()
            stamped.append(body["weight_version"])
            # every answer stamped with the version the replica holds at that moment
            assert (body["snapshot_identity"], body["weight_version"]) == (chain.full, version)
        if restarted.weight_version == version:
            break
        time.sleep(0.05)
    put_back = time.monotonic() - t_restart
    assert (restarted.model_path, restarted.weight_version) == (folder, version), "not put back on the version"
    assert put_back < 2 * INTERVAL + 2  # restored within one probe interval (plus the reload itself)
    assert [r.path for r in restarted.requests if r.path == "/update_weights_from_disk"] == ["/update_weights_from_disk"]
    time.sleep(INTERVAL)
    assert [(r["state"], r["currentSnapshotIdentity"]) for r in _replicas(api, op["spec"]["id"])] == [
        ("READY", chain.full)]
    assert api.complete(prompt=PROMPT, max_tokens=2)["weight_version"] == version


def test_a_hot_load_of_the_served_version_puts_back_a_replica_on_other_weights(chain, tmp_path, running,
                                                                              make_client):
    fake = _fake(chain, running)
    server, api = _gateway(chain, tmp_path / "work", fake, running, probe_interval_s=3600)  # no probe between
    make_client(server).hot_load(chain.full)
    version = fake.weight_version
    port = int(fake.url.rsplit(":", 1)[1])
    fake.die()
    restarted = _fake(chain, running, port)
    op = wait_op(api, _create(api, chain.full)["spec"]["id"])  # the same identity again
    assert op["status"]["state"] == STATE_COMPLETED
    assert restarted.weight_version == version  # reloaded, not "COMPLETED in 0.01 s reloading nothing"
    assert api.complete(prompt=PROMPT, max_tokens=2)["weight_version"] == version


def test_an_engine_that_cannot_be_put_back_is_error_and_takes_no_request(chain, tmp_path, running, make_client,
                                                                         caplog):
    fake = _fake(chain, running)
    server, api = _gateway(chain, tmp_path / "work", fake, running)
    make_client(server).hot_load(chain.full)
    op = _create(api, chain.full)
    port = int(fake.url.rsplit(":", 1)[1])
    fake.die()
    restarted = _fake(chain, running, port)
    for _ in range(50):  # every reload attempt fails: it must not serve
        restarted.fail_next("/update_weights_from_disk", 400, {"success": False, "message": "disk gone"})
    deadline = time.monotonic() + 2 * INTERVAL + 2
    while time.monotonic() < deadline:
        reps = _replicas(api, op["spec"]["id"])
        if reps[0]["state"] == "ERROR" and "failed" in reps[0]["errorReason"]:
            break
        time.sleep(0.05)
    assert reps[0]["state"] == "ERROR" and "disk gone" in reps[0]["errorReason"], reps
    assert "'default'" in reps[0]["errorReason"]
    reply = requests.post(f"{server.url}/v1/completions", headers=api.headers,
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=10)
    assert reply.status_code == 503 and "no replica can serve" in reply.json()["error"]["message"]
    assert not [r for r in restarted.requests if r.path == "/generate" and r.body.get("input_ids") == [PROMPT]]
    time.sleep(3 * INTERVAL)  # tried again at every probe, logged once
    assert len([r for r in restarted.requests if r.path == "/update_weights_from_disk"]) >= 3
    failed = [r for r in caplog.records if r.levelname == "WARNING" and "failed: " in r.getMessage()
              and "disk gone" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in failed]


def test_a_restarted_gateway_adopts_the_version_its_engine_holds(chain, tmp_path, running, make_client):
    fake = _fake(chain, running)
    work = tmp_path / "work"
    first, _ = _gateway(chain, work, fake, running)
    client = make_client(first)
    client.hot_load(chain.full)
    client.hot_load(chain.d1, base_identity=chain.full)
    folder, version = fake.model_path, fake.weight_version
    first.shutdown()
    running.remove(first)
    updates = len([r for r in fake.requests if r.path == "/update_weights_from_disk"])

    second, api = _gateway(chain, work, fake, running)
    health = api.get("/health").json()
    assert (health["snapshotIdentity"], health["boot"]) == (chain.d1, "resumed")
    assert len([r for r in fake.requests if r.path == "/update_weights_from_disk"]) == updates  # nothing reloaded
    assert (fake.model_path, fake.weight_version) == (folder, version)
    assert (work / "models" / version).is_dir()
    reply = api.complete(prompt=PROMPT, max_tokens=2)
    assert (reply["snapshot_identity"], reply["weight_version"]) == (chain.d1, version)


def test_a_damaged_rebuilt_folder_is_not_resumed(chain, tmp_path, running, make_client):
    work = tmp_path / "work"
    first = start_server(chain, work)
    running.append(first)
    make_client(first).hot_load(chain.full)
    (folder,) = (work / "models").iterdir()
    shard = next(folder.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one byte of a tensor, same size: only the tensor checksums see it
    first.shutdown()
    running.remove(first)
    shard.write_bytes(bytes(data))

    second = start_server(chain, work)
    running.append(second)
    api = Api(second.url)
    health = api.get("/health").json()
    assert (health["snapshotIdentity"], health["boot"]) == (None, "clean")
    assert api.greedy() == chain.greedy[0]  # the boot weights, stamped as such
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] is None
    assert not folder.exists()


def test_two_servers_cannot_share_a_work_dir(chain, tmp_path, running):
    import os

    first = start_server(chain, tmp_path / "work")
    running.append(first)
    with pytest.raises(ServeStartError) as e:
        start_server(chain, tmp_path / "work")
    assert str(e.value) == (f"work_dir (--work-dir): work dir {tmp_path / 'work'} is in use by another posttrain "
                            f"serve (pid {os.getpid()})")
    assert Api(first.url).get("/health").status_code == 200


def test_an_identity_too_long_for_a_folder_name_fails_its_hot_load_and_the_next_one_runs(chain, server,
                                                                                          make_client):
    api = Api(server.url)
    op = wait_op(api, _create(api, "x" * 255)["spec"]["id"])  # 255 characters: allowed, and not in the store
    assert op["status"]["state"] == STATE_FAILED  # not RUNNING forever, blocking every later create
    assert "x" * 255 in op["status"]["conditions"][0]["message"]
    assert make_client(server).hot_load(chain.full).state == STATE_COMPLETED


@pytest.mark.parametrize("extra,field", FORBIDDEN, ids=[f for _, f in FORBIDDEN])
def test_the_sglang_gateway_refuses_what_the_reference_server_refuses(chain, tmp_path, running, extra, field):
    fake = _fake(chain, running)
    gateway, _ = _gateway(chain, tmp_path / "gw", fake, running)
    reference = start_server(chain, tmp_path / "ref")
    running.append(reference)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **extra}
    answers = []
    for server in (reference, gateway):
        r = requests.post(f"{server.url}/v1/completions", headers=Api(server.url).headers, json=body, timeout=30)
        answers.append((r.status_code, r.json()["error"]["param"]))
    assert answers == [(400, field), (400, field)]
    assert not [r for r in fake.requests if r.path == "/generate" and r.body.get("input_ids") == [PROMPT]]


def test_the_sglang_gateway_bounds_what_it_builds_not_only_tokens_generated(chain, tmp_path, running):
    fake = _fake(chain, running)
    server, api = _gateway(chain, tmp_path / "gw", fake, running, max_request_tokens=4096)
    generates = len([r for r in fake.requests if r.path == "/generate"])
    for body, param, message in (
        ({"prompt": [5] * 100, "n": 4000, "max_tokens": 1}, "n", "n must be an integer in [1, 64]"),
        ({"prompt": [5] * 100, "n": 64, "max_tokens": 1}, "prompt", "6464 tokens is over this server's limit of 4096"),
    ):
        r = api.post("/v1/completions", json={"model": "tiny", **body})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
        assert message in r.json()["error"]["message"]
    assert len([r for r in fake.requests if r.path == "/generate"]) == generates  # nothing was built or sent
    assert api.complete(prompt=[5] * 100, n=32, max_tokens=2)["choices"]


@pytest.mark.parametrize("controls", [{"temperature": 1e-300}, {"top_p": 1e-320}, {"temperature": 1e-300, "top_p": 1e-320}])
def test_tiny_temperature_or_top_p_samples_the_most_likely_token(server, chain, controls):
    reply = Api(server.url).complete(prompt=PROMPT, max_tokens=8, seed=1, **controls)
    assert reply["choices"][0]["token_ids"] == chain.greedy[0]
    assert all(lp == lp for lp in reply["choices"][0]["logprobs"]["token_logprobs"])  # no NaN


def test_a_255_character_identity_is_hot_loaded_and_served(chain, store_copy, make_server, make_client):
    from posttrain.chain.ops import encode_snapshot
    from tests.support.serving import PREFIX

    identity = "v" * 255  # the longest the format allows: its rebuilt folder's name is shortened, not refused
    encode_snapshot(chain.models[1], store_copy / PREFIX, identity=identity, step=1)
    server = make_server(store=store_copy)
    assert make_client(server).hot_load(identity).state == STATE_COMPLETED
    api = Api(server.url)
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == identity
    assert api.greedy() == chain.greedy[1]
