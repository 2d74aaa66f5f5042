"""RemoteEngine's switch and restore logic with engine servers of our own making (the real-vLLM
tests are in tests/serve/vllm): what happens when a replica fails mid-switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.serve.engine import EngineCallError, EngineError
from posttrain.serve.remote import RemoteEngine, Replica
from tests.support.tensors import save_torch_checkpoint


class Server:
    """An engine server that serves whatever folder it last loaded; ``break_on`` folders break it."""

    def __init__(self, folder: Path, break_on: set[str] = frozenset()):
        self.folder, self.break_on, self.broken, self.calls = folder, break_on, False, []

    def health(self) -> bool:
        return not self.broken

    def complete(self, body: dict) -> dict:
        if self.broken:
            raise EngineCallError(500, "EngineCore encountered an issue")
        value = float(torch.load(self.folder / "w.pt")) if (self.folder / "w.pt").exists() else 0.0
        return {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [value]}}]}

    def pause(self) -> None:
        self.calls.append("pause")

    def reload(self, folder: Path) -> None:
        self.calls.append(f"reload {folder.name}")
        if folder.name in self.break_on:
            self.broken = True
            raise EngineCallError(500, "reload failed")
        self.folder = folder

    def resume(self) -> None:
        self.calls.append("resume")

    def close(self) -> None:
        pass


class Supervisor:
    def __init__(self, server: Server):
        self.server, self.restarts = server, []

    def alive(self) -> bool:
        return True

    def restart(self, model_dir: Path | None = None) -> None:
        self.restarts.append(model_dir.name)
        self.server.broken, self.server.folder = False, model_dir

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


def _version(root: Path, name: str, value: float) -> Path:
    folder = save_torch_checkpoint(root / name, {"w": torch.full((4,), value)})
    torch.save(torch.tensor(value), folder / "w.pt")  # what the fake server "answers" with this folder
    return folder


@pytest.fixture
def versions(tmp_path):
    return {name: _version(tmp_path, name, v) for name, v in (("boot", 0.0), ("v1", 1.0), ("v2", 2.0))}


def _engine(versions, servers, supervised=True):
    replicas = [Replica(f"r{i}", s, Supervisor(s) if supervised else None) for i, s in enumerate(servers)]
    return RemoteEngine(kind="fake", model_dir=versions["boot"], model_name="m", replicas=replicas,
                        monitor_interval_s=3600)


def test_a_reload_that_breaks_one_replica_puts_every_replica_back(versions):
    good, bad = Server(versions["boot"]), Server(versions["boot"], break_on={"v1"})
    engine = _engine(versions, [good, bad])
    with pytest.raises(EngineCallError, match="reload failed"):
        engine.load(versions["v1"], "v1")
    assert engine.current().path == versions["boot"]
    assert good.folder == versions["boot"] and good.calls[-3:] == ["pause", "reload boot", "resume"]
    assert bad.folder == versions["boot"] and engine.replicas[1].process.restarts == ["boot"]
    assert engine.replica_errors() == {}
    engine.load(versions["v2"], "v2")  # the next hot-load succeeds
    assert (good.folder, bad.folder) == (versions["v2"], versions["v2"])
    engine.close()


def test_a_replica_someone_else_runs_is_reported_when_a_reload_broke_it(versions):
    server = Server(versions["boot"], break_on={"v1"})
    engine = _engine(versions, [server], supervised=False)
    with pytest.raises(EngineCallError):
        engine.load(versions["v1"], "v1")
    assert "restart it" in engine.replica_errors()["r0"]
    with pytest.raises(EngineError, match="r0 is not serving"):
        engine.load(versions["v2"], "v2")
    engine.close()


def test_a_reload_the_engine_ignores_is_caught(versions):
    server = Server(versions["boot"])
    server.reload = lambda folder: server.calls.append("ignored")  # answers 200, keeps the old weights
    engine = _engine(versions, [server])
    with pytest.raises(EngineError, match="answers exactly as before"):
        engine.load(versions["v1"], "v1")
    assert engine.current().identity is None
    engine.close()


def test_the_gateway_bounds_the_tokens_one_request_asks_for(versions):
    from posttrain.serve.completions import RequestError

    server = Server(versions["boot"])
    replicas = [Replica("r0", server, Supervisor(server))]
    engine = RemoteEngine(kind="fake", model_dir=versions["boot"], model_name="m", replicas=replicas,
                          monitor_interval_s=3600, max_request_tokens=1000)
    try:
        with pytest.raises(RequestError) as e:
            engine.complete({"model": "m", "prompt": [[1, 2]] * 5000, "n": 64, "max_tokens": 16})
        assert e.value.status == 400 and "max_request_tokens" in e.value.message and "1000" in e.value.message
        assert engine.complete({"model": "m", "prompt": [[1, 2]] * 10, "n": 4, "max_tokens": 23})["choices"]
    finally:
        engine.close()


def _tied(folder: Path) -> Path:
    (folder / "config.json").write_text('{"tie_word_embeddings": true}')
    return folder


def test_a_tied_model_refused_at_a_url_leaves_the_replica_serving(versions):
    server = Server(versions["boot"])
    engine = RemoteEngine(kind="vllm", model_dir=versions["boot"], model_name="m",
                          replicas=[Replica("r0", server)], restart_when_tied=True, monitor_interval_s=3600)
    try:
        with pytest.raises(EngineError, match="r0: cannot restart an engine someone else runs"):
            engine.load(_tied(versions["v1"]), "v1")
        assert server.calls == [] and server.folder == versions["boot"]  # never touched
        assert engine.replica_errors() == {}
        assert engine.complete({"model": "m", "prompt": [1, 2], "max_tokens": 1})["snapshot_identity"] is None
        engine.load(versions["v2"], "v2")  # untied: reloaded in place as usual
        assert server.folder == versions["v2"]
    finally:
        engine.close()


def test_an_in_place_reload_of_a_tied_model_into_vllm_is_refused_before_any_replica_is_touched(versions):
    """Measured on vLLM's CPU build: a tied model reloaded in place answers as neither version while every
    digest it can report is right, so --reload in-place is refused for it, snapshot probe or not."""
    server = Server(versions["boot"])
    engine = RemoteEngine(kind="vllm", model_dir=versions["boot"], model_name="m", reload="in-place",
                          replicas=[Replica("r0", server)], restart_when_tied=True, monitor_interval_s=3600)
    try:
        with pytest.raises(EngineError, match="ties the LM head to the embeddings.*--reload auto or restart"):
            engine.load(_tied(versions["v1"]), "v1")
        assert server.calls == [] and server.folder == versions["boot"]
        assert engine.replica_errors() == {}
    finally:
        engine.close()


def test_reload_restart_with_vllm_at_a_url_is_refused_at_start(versions):
    from pydantic import ValidationError

    from posttrain.serve.serve_config import ServeConfig

    with pytest.raises(ValidationError, match="reload restart needs engines the gateway starts"):
        ServeConfig(model_dir=versions["boot"], deployment_id="d", store="/tmp", token="t", engine="vllm",
                    engine_urls=["http://127.0.0.1:1"], reload="restart")


def test_a_replica_at_a_url_found_on_other_weights_is_put_back(versions):
    server = Server(versions["boot"])
    engine = _engine(versions, [server], supervised=False)
    try:
        engine.load(versions["v1"], "v1")
        server.folder = versions["boot"]  # restarted by whoever runs it, on its launch weights
        engine.verify()
        assert server.folder == versions["v1"] and server.calls[-3:] == ["pause", "reload v1", "resume"]
        assert engine.replica_errors() == {}
        server.folder = versions["boot"]
        server.reload = lambda folder: server.calls.append("ignored")  # and now it will not take it back
        with pytest.raises(EngineError, match="r0: its answers to the probe prompt are 1 away from v1's"):
            engine.verify()
        with pytest.raises(Exception, match="no replica can serve"):
            engine.complete({"model": "m", "prompt": [1, 2], "max_tokens": 1})
    finally:
        engine.close()


def test_a_supervised_replica_on_other_weights_is_reloaded_in_place_and_restarted_only_when_that_fails(versions):
    server = Server(versions["boot"])
    engine = _engine(versions, [server])
    supervisor = engine.replicas[0].process
    try:
        engine.load(versions["v1"], "v1")
        server.folder = versions["boot"]  # dropped back to its boot weights behind the gateway's back
        engine.verify()
        assert server.folder == versions["v1"] and server.calls[-3:] == ["pause", "reload v1", "resume"]
        assert supervisor.restarts == []  # seconds, not a restart's minute
        server.folder, server.break_on = versions["boot"], {"v1"}  # and now its reload breaks it
        engine.verify()
        assert supervisor.restarts == ["v1"] and server.folder == versions["v1"] and not server.broken
        assert engine.replica_errors() == {}
        server.folder, server.break_on = versions["boot"], set()
        server.reload = lambda folder: server.calls.append("ignored")  # answers 200, keeps the old weights
        engine.verify()  # read back on other weights after the reload: restarted
        assert server.calls[-2:] == ["ignored", "resume"] and supervisor.restarts == ["v1", "v1"]
        assert server.folder == versions["v1"] and engine.replica_errors() == {}
    finally:
        engine.close()


def test_an_engine_failing_requests_is_a_503_and_its_replica_is_checked_again(versions):
    """An engine answering 5xx (restarting, crashed) is not the client's error: 503, try again, and the
    replica takes no request until it is checked and put back."""
    from posttrain.serve.completions import RequestError

    server = Server(versions["boot"])
    engine = _engine(versions, [server], supervised=False)
    server.broken = True
    with pytest.raises(RequestError) as e:
        engine.complete({"model": "m", "prompt": [[1, 2]], "max_tokens": 1})
    assert (e.value.status, e.value.kind) == (503, "ServiceUnavailableError")
    with pytest.raises(RequestError) as again:  # suspect: not asked until checked
        engine.complete({"model": "m", "prompt": [[1, 2]], "max_tokens": 1})
    assert again.value.status == 503
    engine.close()


def test_an_adapter_is_loaded_again_only_into_an_engine_that_no_longer_serves_it(versions):
    """After a restart the engine has no adapter: it is loaded again. After an in-place reload of the base
    it still serves it, and vLLM refuses a second load of the same name: not loaded again."""
    server = Server(versions["boot"])
    loaded: list[str] = []
    server.served_models = lambda: ["m", *loaded]
    server.load_adapter = lambda name, folder: loaded.append(name)
    engine = _engine(versions, [server])
    try:
        engine._adapter = "adapter-1"
        engine._reattach(engine.replicas[0])  # restarted: not served, loaded
        engine._reattach(engine.replicas[0])  # reloaded in place: still served, left alone
        assert loaded == ["adapter-1"]
    finally:
        engine.close()
