"""A vLLM someone else runs (the gateway at its URL, ``engine_urls``), against REAL vLLM: restarted on its launch
weights it is never stamped with the served version and is put back; a tied model is refused before vLLM is
touched. A module of its own: the engines here start while no other gateway's engine is alive (see
tests/support/vllm_gateway.py)."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.inference.contract import HotLoadFailed
from posttrain.serve.vllm.process import VLLMProcess, VLLMProcessConfig
from tests.support.serving import Api
from tests.support.vllm import assert_matches, require_vllm, served_greedy, transformers_greedy
from tests.support.vllm_gateway import assert_stamped_right, gateway_chain, gateway_loader, untied_chain, vllm_gateway

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> dict:
    return untied_chain(tmp_path_factory.mktemp("untied"))


def test_a_vllm_at_a_url_restarted_on_its_launch_weights_is_never_stamped_and_is_put_back(
    untied, make_client, tmp_path
):
    """Someone else runs vLLM; it restarts on the folder it was launched with. Every answer the gateway
    stamps comes from the stamped version, and the gateway reloads that version into it."""
    engine = VLLMProcess(VLLMProcessConfig(served_model_name="tiny", log_file=tmp_path / "theirs.log"))
    engine.start(untied["models"][0])
    server = None
    try:
        server = vllm_gateway(untied, tmp_path / "work", engine_urls=[engine.url], probe_interval_s=1.0)
        api = Api(server.url)
        loader = gateway_loader(server, make_client)
        loader.hot_load(untied["ids"][0])
        loader.hot_load(untied["ids"][1], base_identity=untied["ids"][0])
        assert_matches(served_greedy(api)[0], untied["refs"][1])

        restarter = threading.Thread(target=engine.restart, args=(untied["models"][0],))
        restarter.start()
        answered, deadline = [], time.monotonic() + 300
        while time.monotonic() < deadline:
            # never the launch weights stamped as ids[1]
            if assert_stamped_right(api, untied["ids"][1], untied["refs"][1]):
                answered.append(not restarter.is_alive())
                if answered[-1]:
                    break
            time.sleep(0.5)
        restarter.join()
        assert answered and answered[-1], "the gateway never served again after the engine restarted"
        assert not server.engine.replica_errors()
    finally:
        if server is not None:
            server.shutdown()
        engine.stop()  # "someone else's" engine: the gateway does not stop it (it leaked after the suite)
        engine.stop()


def test_a_tied_model_at_a_url_refuses_the_hot_load_and_keeps_serving(make_client, tmp_path):
    """vLLM's CPU build reloads a tied model wrongly in place, and an engine someone else runs cannot be
    restarted by the gateway: the hot-load is refused before vLLM is touched, and it keeps serving."""
    tied = gateway_chain(tmp_path / "tied", tied=True)
    engine = VLLMProcess(VLLMProcessConfig(served_model_name="tiny", log_file=tmp_path / "theirs.log"))
    engine.start(tied["models"][0])
    server = None
    try:
        server = vllm_gateway(tied, tmp_path / "work", engine_urls=[engine.url])
        api = Api(server.url)
        refs = transformers_greedy(tied["models"][0])
        with pytest.raises(HotLoadFailed, match="cannot restart an engine someone else runs"):
            gateway_loader(server, make_client).hot_load(tied["ids"][1], base_identity=tied["ids"][0])
        op_id = api.ops()[0]["spec"]["id"]
        replicas = api.get(f"/v1alpha1/inference/hotLoads/{op_id}/replicas").json()["replicas"]
        assert [r["state"] for r in replicas] == ["READY"]
        assert assert_stamped_right(api, None, refs)  # still the launch weights, stamped as such
    finally:
        if server is not None:
            server.shutdown()
        engine.stop()
