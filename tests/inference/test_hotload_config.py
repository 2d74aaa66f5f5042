"""The client's configuration, operation ids and checks made on what it sends and receives (no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.inference.contract import HotLoadAPIError
from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig, operation_id_for
from posttrain.inference.protocol import STATE_RUNNING
from posttrain.serve.serve_config import ServeConfig, read_token
from tests.inference.fake_http import FakeSession, reply
from tests.support.serving import TOKEN


def test_operation_ids_are_deterministic_uuids():
    a = operation_id_for("dep", "step-1", 0)
    assert a == operation_id_for("dep", "step-1", 0)
    assert len({a, operation_id_for("dep", "step-1", 1), operation_id_for("dep2", "step-1", 0),
                operation_id_for("dep", "step-2", 0)}) == 4
    assert len(a) == 36 and a.count("-") == 4


def test_config_defaults_and_validation(monkeypatch):
    cfg = HotLoadConfig(deployment_id="d", token=TOKEN)
    assert cfg.api_url == "https://api.coreweave.com" and cfg.fallback_to_full
    assert cfg.prompt_cache_policy == "PROMPT_CACHE_POLICY_RESET_ALL"
    assert TOKEN not in repr(cfg) and TOKEN not in str(cfg.model_dump())
    with pytest.raises(ValidationError):
        HotLoadConfig(deployment_id="d", token=TOKEN, retries=3)
    with pytest.raises(ValidationError):
        HotLoadConfig(deployment_id="d", token=TOKEN, api_url="https://user:pw@host")
    with pytest.raises(ValidationError):
        HotLoadConfig(deployment_id="d", token=TOKEN, prompt_cache_policy="KEEP")
    assert HotLoadConfig(deployment_id="d", token=TOKEN, api_url="http://127.0.0.1:1/").api_url == "http://127.0.0.1:1"
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    assert HotLoadConfig.from_env(token_env="MY_TOKEN", deployment_id="d").token.get_secret_value() == TOKEN
    monkeypatch.delenv("MY_TOKEN")
    with pytest.raises(ValueError, match="MY_TOKEN"):
        HotLoadConfig.from_env(token_env="MY_TOKEN", deployment_id="d")


@pytest.mark.parametrize("model", [HotLoadConfig, ServeConfig])
def test_every_field_is_described(model):
    assert all(f.description for f in model.model_fields.values())


def test_identities_are_checked_before_any_call():
    session = FakeSession()  # any call would fail the test with "unexpected call"
    client = CoreWeaveHotLoader(HotLoadConfig(deployment_id="d", token=TOKEN), session=session)
    with pytest.raises(ValueError, match="one path segment"):
        client.hot_load("../etc")
    with pytest.raises(ValueError, match="base_identity"):
        client.hot_load("step-1", base_identity="a/b")
    with pytest.raises(ValueError, match="identity"):
        client.hot_load("")
    assert session.calls == []


def test_an_operation_found_under_our_id_for_another_snapshot_is_refused():
    op_id = operation_id_for("d", "step-1", 0)
    other = {"hotLoad": {"spec": {"id": op_id, "identity": "step-9", "deploymentId": "d"},
                         "status": {"state": STATE_RUNNING}}}
    session = FakeSession([reply(200, other)])
    client = CoreWeaveHotLoader(HotLoadConfig(deployment_id="d", token=TOKEN), session=session)
    with pytest.raises(HotLoadAPIError, match=f"hot-load {op_id} is for identity 'step-9' on deployment 'd', "
                                              "expected 'step-1' on 'd'"):
        client.hot_load("step-1")
    (call,) = session.calls
    assert call["method"] == "GET" and call["url"].endswith(f"/hotLoads/{op_id}")


def test_read_token(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert read_token(file=f).get_secret_value() == TOKEN
    f.write_text("")
    with pytest.raises(ValueError, match="empty") as info:
        read_token(file=f)
    monkeypatch.setenv("T_ENV", TOKEN)
    assert read_token(env="T_ENV").get_secret_value() == TOKEN
    monkeypatch.delenv("T_ENV")
    with pytest.raises(ValueError, match="T_ENV") as info:
        read_token(env="T_ENV")
    assert TOKEN not in str(info.value)


@pytest.mark.parametrize("value", [1e-300, 0, float("nan"), float("inf")])
def test_a_busy_poll_of_a_hot_load_is_refused(value):
    """1e-300 passed ``> 0``; the client then polled the hot-load without pause. The block's
    poll_interval_s and posttrain serve's probe interval have the same floor."""
    from posttrain.pipeline.blocks import InferenceDeployment

    with pytest.raises(ValidationError, match="poll_interval"):
        HotLoadConfig(deployment_id="d", token=TOKEN, poll_interval=value)
    with pytest.raises(ValidationError, match="poll_interval_s"):
        InferenceDeployment(gateway_url="http://127.0.0.1:1", deployment_id="d", model="m", token=TOKEN,
                            poll_interval_s=value)
    with pytest.raises(ValidationError, match="probe_interval_s"):
        ServeConfig(model_dir="/m", deployment_id="d", store="/s", token=TOKEN, probe_interval_s=value)
