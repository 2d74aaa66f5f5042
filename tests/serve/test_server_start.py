"""A server that fails to start after its engine is up closes the engine (a vLLM engine's processes
would outlive the error), the store and the work dir's lock."""

from __future__ import annotations

import pytest

from tests.support.serving import start_server


class StubEngine:
    model_name = "tiny"
    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_start_that_fails_after_the_engine_is_up_closes_it(chain, tmp_path, monkeypatch):
    import posttrain.serve.server as server_module

    def broken(**kwargs):
        raise RuntimeError("the hot-load service cannot start")

    engine = StubEngine()
    monkeypatch.setattr(server_module, "HotLoadService", broken)
    from pydantic import SecretStr

    from posttrain.serve.serve_config import ServeConfig

    config = ServeConfig(model_dir=chain.models[0], port=0, deployment_id="dep", store=str(chain.store),
                         token=SecretStr("t"), work_dir=tmp_path / "work")
    with pytest.raises(RuntimeError, match="cannot start"):
        server_module.InferenceServer(config, engine=engine)
    assert engine.closed
    monkeypatch.undo()
    start_server(chain, tmp_path / "work").shutdown()  # the work dir's lock was released
