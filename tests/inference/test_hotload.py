"""The hot-load client against the real reference server: chains, failures, faults and recovery."""

from __future__ import annotations

import logging
import shutil
import threading
import time

import pytest

from posttrain.inference.contract import (
    HotLoadAPIError,
    HotLoader,
    HotLoadFailed,
    HotLoadTimeout,
    HotLoadUnavailable,
)
from posttrain.inference.protocol import (
    API_PREFIX,
    GRPC_FAILED_PRECONDITION,
    GRPC_UNIMPLEMENTED,
    STATE_COMPLETED,
    STATE_FAILED,
    TYPE_FULL,
    TYPE_INCREMENTAL,
)
from tests.support.serving import DEPLOYMENT, PREFIX, PROMPT, TOKEN, Api


def _replica_identities(api: Api, op_id: str) -> list[str]:
    return [r["currentSnapshotIdentity"] for r in api.get(f"{API_PREFIX}/{op_id}/replicas").json()["replicas"]]


def test_full_then_deltas_follow_the_chain(server, api, make_client, chain):
    client = make_client(server)
    assert isinstance(client, HotLoader)
    assert api.greedy() == chain.greedy[0]

    full = client.hot_load(chain.full)
    assert (full.identity, full.snapshot_type, full.state) == (chain.full, TYPE_FULL, STATE_COMPLETED)
    assert full.attempts == 1 and not full.adopted and not full.fell_back
    assert [r.current_snapshot_identity for r in full.replicas] == [chain.full]
    assert api.greedy() == chain.greedy[0]  # same weights as the boot model

    d1 = client.hot_load(chain.d1, base_identity=chain.full)
    assert d1.snapshot_type == TYPE_INCREMENTAL and d1.identity == chain.d1
    assert api.greedy() == chain.greedy[1]
    d2 = client.hot_load(chain.d2, base_identity=chain.d1)
    assert api.greedy() == chain.greedy[2]
    assert _replica_identities(api, d2.operation_id) == [chain.d2]
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == chain.d2

    op = api.get(f"{API_PREFIX}/{d2.operation_id}").json()["hotLoad"]
    assert op["spec"]["identity"] == chain.d2 and op["spec"]["deploymentId"] == DEPLOYMENT
    assert op["spec"]["promptCachePolicy"] == "PROMPT_CACHE_POLICY_RESET_ALL"
    assert [s["identity"] for s in op["status"]["snapshotChain"]] == [chain.d2]  # only the delta after d1
    assert [o["spec"]["identity"] for o in api.ops()] == [chain.d2, chain.d1, chain.full]  # newest first

    # back to the full snapshot, then two deltas at once from the version held
    client.hot_load(chain.full)
    assert api.greedy() == chain.greedy[0]
    again = client.hot_load(chain.d2, base_identity=chain.d1)
    assert api.greedy() == chain.greedy[2]
    op = api.get(f"{API_PREFIX}/{again.operation_id}").json()["hotLoad"]
    assert [s["identity"] for s in op["status"]["snapshotChain"]] == [chain.d1, chain.d2]


def test_a_delta_from_boot_weights_resolves_back_to_the_full_snapshot(server, api, make_client, chain):
    make_client(server).hot_load(chain.d2, base_identity=chain.d1)
    assert api.greedy() == chain.greedy[2]
    op = api.ops()[0]
    assert [s["identity"] for s in op["status"]["snapshotChain"]] == [chain.full, chain.d1, chain.d2]


def test_boot_weights_that_record_their_version_take_deltas(make_server, make_client, chain, tmp_path):
    from posttrain.chain.ops import reconstruct

    boot = tmp_path / "boot"
    reconstruct(chain.store / PREFIX, chain.d1, boot)
    server = make_server(model_dir=boot)
    api = Api(server.url)
    assert api.greedy() == chain.greedy[1]
    make_client(server).hot_load(chain.d2, base_identity=chain.d1)
    assert api.greedy() == chain.greedy[2]
    assert [s["identity"] for s in api.ops()[0]["status"]["snapshotChain"]] == [chain.d2]


def test_calling_again_adopts_the_completed_operation(server, api, make_client, chain):
    client = make_client(server)
    first = client.hot_load(chain.full)
    second = client.hot_load(chain.full)
    assert second.operation_id == first.operation_id and second.adopted and second.attempts == 0
    assert api.stats()["creates"] == {chain.full: 1}
    client.hot_load(chain.d1, base_identity=chain.full)
    third = client.hot_load(chain.full)  # the first operation no longer describes what is served
    assert third.operation_id != first.operation_id and not third.adopted
    assert api.stats()["creates"][chain.full] == 2


def test_corrupted_delta_fails_and_the_old_weights_keep_serving(make_server, make_client, chain, store_copy):
    shard = store_copy / PREFIX / chain.d1 / "model-00000.safetensors"
    data = bytearray(shard.read_bytes())
    for i in range(len(data) - 64, len(data)):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    server = make_server(store=store_copy)
    api = Api(server.url)
    client = make_client(server, fallback_to_full=False)
    client.hot_load(chain.full)
    with pytest.raises(HotLoadFailed) as info:
        client.hot_load(chain.d1, base_identity=chain.full)
    op = api.get(f"{API_PREFIX}/{info.value.operation_id}").json()["hotLoad"]
    assert op["status"]["state"] == STATE_FAILED
    (cond,) = op["status"]["conditions"]
    assert cond["reason"] and cond["message"] and cond["reason"] in str(info.value)
    assert api.greedy() == chain.greedy[0]
    assert _replica_identities(api, info.value.operation_id) == [chain.full]
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == chain.full


def test_missing_base_and_wrong_base_fail_with_their_reason(make_server, make_client, chain, store_copy):
    shutil.rmtree(store_copy / PREFIX / chain.full)
    server = make_server(store=store_copy)
    api = Api(server.url)
    client = make_client(server, fallback_to_full=False)
    with pytest.raises(HotLoadFailed, match="not in the store"):
        client.hot_load(chain.d1, base_identity=chain.full)
    with pytest.raises(HotLoadFailed, match=f"delta against {chain.d1}, not against {chain.full}"):
        client.hot_load(chain.d2, base_identity=chain.full)
    with pytest.raises(HotLoadFailed, match="is a delta snapshot"):
        client.hot_load(chain.d1)  # a delta loaded as SNAPSHOT_TYPE_FULL
    assert api.greedy() == chain.greedy[0]
    assert [o["status"]["state"] for o in api.ops()] == [STATE_FAILED] * 3


def test_failed_incremental_falls_back_to_a_published_full_snapshot(server, api, make_client, chain):
    from posttrain.chain.ops import encode_snapshot

    client = make_client(server)
    client.hot_load(chain.full)
    api.faults({"kind": "fail_hotload", "reason": "injected: replica could not apply the delta",
                "snapshot_type": TYPE_INCREMENTAL})
    published = []

    def publish_full() -> str:
        r = encode_snapshot(chain.models[1], chain.store / PREFIX, identity="fallback-full-m1", step=1)
        published.append(r.identity)
        return r.identity

    try:
        result = client.hot_load(chain.d1, base_identity=chain.full, publish_full=publish_full)
    finally:
        shutil.rmtree(chain.store / PREFIX / "fallback-full-m1", ignore_errors=True)  # the store is shared
    assert published == ["fallback-full-m1"]
    assert result.fell_back and result.identity == "fallback-full-m1" and result.snapshot_type == TYPE_FULL
    assert result.failed_identity == chain.d1 and "could not apply the delta" in result.failure_reason
    assert api.greedy() == chain.greedy[1]
    assert [o["status"]["state"] for o in api.ops()] == [STATE_COMPLETED, STATE_FAILED, STATE_COMPLETED]


def test_without_a_callback_the_incremental_failure_is_raised(server, api, make_client, chain):
    client = make_client(server)
    client.hot_load(chain.full)
    api.faults({"kind": "fail_hotload", "reason": "injected"})
    with pytest.raises(HotLoadFailed, match="no publish_full callback"):
        client.hot_load(chain.d1, base_identity=chain.full)


def test_replica_in_error_is_reported(make_server, make_client, chain):
    server = make_server(replicas=3)
    api = Api(server.url)
    api.faults({"kind": "replica_error", "reason": "CUDA out of memory while loading"})
    client = make_client(server, replica_page_size=1)
    with pytest.raises(HotLoadFailed, match="replica-0000: CUDA out of memory while loading") as info:
        client.hot_load(chain.full)
    assert "replica in ERROR" in str(info.value)
    assert api.greedy() == chain.greedy[0]
    result = client.hot_load(chain.full)  # the next hot-load brings the replica back
    assert len(result.replicas) == 3 and {r.state for r in result.replicas} == {"READY"}


def test_lost_create_reply_finds_the_operation_instead_of_creating_another(server, api, make_client, chain,
                                                                          caplog):
    api.faults({"kind": "drop_create_reply"})
    client = make_client(server)
    with caplog.at_level(logging.INFO, logger="posttrain.inference.hotload"):
        result = client.hot_load(chain.full)
    assert result.identity == chain.full and result.adopted and result.attempts == 1
    assert api.stats()["creates"] == {chain.full: 1}
    assert [o["spec"]["id"] for o in api.ops()] == [result.operation_id]
    assert "created although its reply was lost" in caplog.text
    assert api.stats()["pending"] == []  # the fault did fire


def test_no_second_create_while_one_is_unfinished(server, api, make_client, chain):
    api.faults({"kind": "delay_hotload", "seconds": 1.0})
    body = {"deploymentId": DEPLOYMENT, "identity": chain.full, "type": TYPE_FULL, "hotLoadId": "manual-1"}
    assert api.post(API_PREFIX, json=body).status_code == 200
    refused = api.post(API_PREFIX, json={**body, "hotLoadId": "manual-2"})
    assert refused.status_code == 400 and refused.json()["code"] == GRPC_FAILED_PRECONDITION

    result = make_client(server).hot_load(chain.d1, base_identity=chain.full)
    assert result.identity == chain.d1 and result.attempts == 1
    ops = {o["spec"]["id"]: o for o in api.ops()}
    assert set(ops) == {"manual-1", result.operation_id}
    assert ops["manual-1"]["status"]["finishedAt"] <= ops[result.operation_id]["status"]["createdAt"]
    assert api.greedy() == chain.greedy[1]


def test_an_unfinished_operation_of_the_same_identity_is_followed(server, api, make_client, chain):
    api.faults({"kind": "delay_hotload", "seconds": 0.5})
    body = {"deploymentId": DEPLOYMENT, "identity": chain.full, "type": TYPE_FULL, "hotLoadId": "theirs"}
    assert api.post(API_PREFIX, json=body).status_code == 200
    result = make_client(server).hot_load(chain.full)
    assert result.operation_id == "theirs" and result.adopted and result.attempts == 0
    assert api.stats()["creates"] == {chain.full: 1}


def test_retries_on_5xx_and_429_with_retry_after(server, api, chain):
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

    api.faults(
        {"kind": "http_error", "status": 503, "count": 2, "method": "GET", "path_prefix": API_PREFIX},
        {"kind": "http_error", "status": 429, "method": "POST", "path_prefix": API_PREFIX, "retry_after": 0.2},
    )
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        time.sleep(seconds)

    config = HotLoadConfig(api_url=server.url, deployment_id=DEPLOYMENT, token=TOKEN, poll_interval=0.05,
                           timeout=30, request_timeout=10, backoff_base=0.01, backoff_max=0.05)
    with CoreWeaveHotLoader(config, sleep=sleep) as client:
        result = client.hot_load(chain.full)
    assert result.retries == 3 and api.stats()["pending"] == []
    assert sleeps.count(0.2) == 1  # the 429's Retry-After, longer than any backoff (<= 0.05) or poll (0.05)
    assert all(s <= 0.05 for s in sleeps if s != 0.2)
    assert api.stats()["creates"] == {chain.full: 1}


def test_client_errors_are_not_retried_and_name_the_call(server, api, make_client, chain):
    api.faults({"kind": "http_error", "status": 403, "count": 2, "method": "GET", "path_prefix": API_PREFIX})
    with pytest.raises(HotLoadAPIError) as info:
        make_client(server).hot_load(chain.full)
    assert info.value.status == 403 and "get hot-load" in str(info.value) and DEPLOYMENT in str(info.value)
    assert [f["count"] for f in api.stats()["pending"]] == [1]  # one call, not retried
    api.session.delete(server.url + "/_test/faults", headers=api.headers)

    with pytest.raises(HotLoadAPIError) as info:
        make_client(server, deployment_id="no-such-deployment").hot_load(chain.full)
    assert info.value.status == 404 and "create hot-load" in str(info.value)
    assert "no-such-deployment" in str(info.value) and TOKEN not in str(info.value)


def test_timeout_while_the_operation_runs(server, api, make_client, chain):
    api.faults({"kind": "delay_hotload", "seconds": 1.5})
    with pytest.raises(HotLoadTimeout, match="still HOT_LOAD_STATE_RUNNING"):
        make_client(server, timeout=0.5).hot_load(chain.full)
    server.service.wait(timeout=10)
    # the operation finished meanwhile: calling again follows it instead of creating another
    result = make_client(server).hot_load(chain.full)
    assert result.adopted and api.stats()["creates"] == {chain.full: 1}


def test_cancel_is_unimplemented(server, api, make_client, chain):
    result = make_client(server).hot_load(chain.full)
    r = api.post(f"{API_PREFIX}/{result.operation_id}:cancel")
    assert r.status_code == 501 and r.json()["code"] == GRPC_UNIMPLEMENTED


def test_list_pages_keep_their_filter(server, api, make_client, chain):
    client = make_client(server, list_page_size=1)
    client.hot_load(chain.full)
    client.hot_load(chain.d1, base_identity=chain.full)
    client.hot_load(chain.d2, base_identity=chain.d1)
    assert [o["spec"]["identity"] for o in client.list_operations()] == [chain.d2, chain.d1, chain.full]
    first = api.get(API_PREFIX, params={"parentDeploymentId": DEPLOYMENT, "maxPageSize": 2}).json()
    assert len(first["hotLoads"]) == 2 and first["nextPageToken"]
    other = api.get(API_PREFIX, params={"parentDeploymentId": "x", "pageToken": first["nextPageToken"]})
    assert other.status_code == 400
    rest = api.get(API_PREFIX, params={"parentDeploymentId": DEPLOYMENT, "maxPageSize": 2,
                                       "pageToken": first["nextPageToken"]}).json()
    assert [o["spec"]["identity"] for o in rest["hotLoads"]] == [chain.full] and rest["nextPageToken"] == ""
    assert api.get(API_PREFIX, params={"maxPageSize": -1}).status_code == 400


def test_in_flight_requests_finish_on_the_old_weights(server, api, make_client, chain):
    client = make_client(server)
    client.hot_load(chain.full)
    done: dict = {}

    def long_request():
        done["body"] = Api(server.url).complete(prompt=PROMPT, n=48, max_tokens=400, temperature=0)
        done["at"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.2)
    client.hot_load(chain.d1, base_identity=chain.full)
    swapped_at = time.monotonic()
    t.join(60)
    body = done["body"]
    assert body["snapshot_identity"] == chain.full
    assert all(c["token_ids"][:8] == chain.greedy[0] for c in body["choices"])
    assert api.greedy() == chain.greedy[1]
    assert swapped_at < done["at"], "the swap did not happen while the request was in flight"


def test_the_token_never_leaks(server, api, make_client, chain, caplog):
    from posttrain.inference.hotload import HotLoadConfig

    caplog.set_level(logging.DEBUG)
    errors: list[BaseException] = []
    client = make_client(server)
    client.hot_load(chain.full)
    api.faults({"kind": "replica_error", "reason": "boom"}, {"kind": "drop_create_reply"},
               {"kind": "http_error", "status": 503, "method": "GET", "path_prefix": API_PREFIX})
    for call in (lambda: client.hot_load(chain.d1, base_identity=chain.full),
                 lambda: make_client(server, deployment_id="nope").hot_load(chain.full),
                 lambda: make_client(server, token="wrong-token").hot_load(chain.full),
                 lambda: make_client(server, api_url="http://127.0.0.1:9", max_attempts=2).hot_load(chain.full)):
        try:
            call()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    assert len(errors) == 4
    texts = [caplog.text, repr(client), repr(client.config), client.config.model_dump_json(), str(client.config)]
    for e in errors:
        while e is not None:
            texts += [str(e), repr(e)]
            e = e.__cause__ or e.__context__
    assert all(TOKEN not in t for t in texts)
    assert "**********" in repr(HotLoadConfig(deployment_id="d", token=TOKEN))



def test_snapshot_cache_is_emptied_after_a_load(server, make_client, chain):
    """Downloaded snapshots are dropped once the served folder holds the version: the cache stays bounded."""
    client = make_client(server)
    client.hot_load(chain.full)
    client.hot_load(chain.d1, base_identity=chain.full)
    cache = server.config.work_dir / "cache"
    assert cache.is_dir()
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []


def test_an_hour_of_retry_after_ends_at_the_clients_timeout(server, api, make_client, chain):
    api.faults({"kind": "http_error", "status": 503, "count": 100, "method": "GET", "path_prefix": API_PREFIX,
                "retry_after": 3600})
    t0 = time.monotonic()
    with pytest.raises(HotLoadUnavailable, match="deadline"):
        make_client(server, timeout=1.5, max_attempts=100).hot_load(chain.full)
    assert time.monotonic() - t0 < 10
