"""VLLMProcess and VLLMClient errors that need no vLLM: refused starts and a server that is not there."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from posttrain.serve.engine import EngineUnavailable
from posttrain.serve.vllm import EngineStartError, VLLMClient, VLLMProcess, VLLMProcessConfig
from posttrain.serve.vllm.process import free_port


def test_start_refuses_a_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="no config.json"):
        VLLMProcess().start(tmp_path)


def test_start_names_a_missing_python(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    proc = VLLMProcess(VLLMProcessConfig(python=tmp_path / "nope" / "python"))
    with pytest.raises(EngineStartError, match="setup-vllm.sh"):
        proc.start(tmp_path)
    assert proc.pids() == [] and not proc.alive()


def test_start_refuses_a_taken_port(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "python").write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = VLLMProcess(VLLMProcessConfig(python=tmp_path / "python", port=s.getsockname()[1]))
        with pytest.raises(EngineStartError, match="is taken"):
            proc.start(tmp_path)


def test_config_forbids_unknown_fields() -> None:
    with pytest.raises(ValueError, match="extra"):
        VLLMProcessConfig(gpu=True)  # type: ignore[call-arg]


def test_client_on_a_closed_port() -> None:
    with VLLMClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client:
        assert client.health() is False
        with pytest.raises(EngineUnavailable) as err:
            client.served_models()
        assert err.value.status == 0
