"""The client's configuration and operation ids (no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig, operation_id_for
from posttrain.serve.serve_config import ServeConfig, read_token
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
    client = CoreWeaveHotLoader(HotLoadConfig(deployment_id="d", token=TOKEN, api_url="http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="one path segment"):
        client.hot_load("../etc")
    with pytest.raises(ValueError, match="base_identity"):
        client.hot_load("step-1", base_identity="a/b")


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
