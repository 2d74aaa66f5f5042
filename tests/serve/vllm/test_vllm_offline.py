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


def test_a_worker_killed_by_a_signal_is_named_among_the_log_errors_and_the_reason_is_one_line(tmp_path: Path) -> None:
    from posttrain.serve.vllm.process import VLLM_ENV

    assert VLLM_ENV["PYTHONFAULTHANDLER"] == "1"  # else a worker killed by a signal leaves no line naming why
    # what vLLM's log then holds when its worker dies of SIGILL in the AMX attention kernel
    log = tmp_path / "vllm.log"
    log.write_text(
        "(Worker pid=1) INFO loading model\n"
        "Fatal Python error: Illegal instruction\n\n"
        '  File ".../vllm/_custom_ops.py", line 3927 in cpu_attention_with_kv_cache\n'
        "(EngineCore pid=2) ERROR RuntimeError: cancelled\n"
        "(APIServer pid=3) ERROR ValueError: cannot reach http://user:s3cr3t-pass@127.0.0.1:9/ (refused)\n"
    )
    proc = VLLMProcess(VLLMProcessConfig(log_file=log))
    errors = proc.log_errors()
    assert errors[:2] == ["Fatal Python error: Illegal instruction", "RuntimeError: cancelled"]
    assert "s3cr3t-pass" not in errors[2] and errors[2].startswith("ValueError: cannot reach")  # scrubbed
    error = EngineStartError("vLLM answers /health but cannot generate: 500\nerrors in its log: x", "tail")
    assert error.reason == "vLLM answers /health but cannot generate: 500; errors in its log: x"
    assert "tail" in str(error) and "\n" not in error.reason


def test_config_forbids_unknown_fields() -> None:
    with pytest.raises(ValueError, match="extra"):
        VLLMProcessConfig(gpu=True)  # type: ignore[call-arg]


def test_client_on_a_closed_port() -> None:
    with VLLMClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client:
        assert client.health() is False
        with pytest.raises(EngineUnavailable) as err:
            client.served_models()
        assert err.value.status == 0


FAKE_VLLM = """#!{python}
# Stands in for vLLM's Python: serves /health and /v1/completions on --port, and takes a second to
# exit on SIGTERM (as vLLM takes its time), so a close() can come while a restart is stopping it.
# Its first $FAKE_VLLM_HANGS starts (counted in the model folder) print a line and hang.
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(sys.argv[sys.argv.index("--port") + 1])
STARTS = os.path.join(sys.argv[sys.argv.index("--model") + 1], "starts")
START = (int(open(STARTS).read()) if os.path.exists(STARTS) else 0) + 1
open(STARTS, "w").write(str(START))
print(f"fake vLLM start {{START}}", flush=True)
if START <= int(os.environ.get("FAKE_VLLM_HANGS", "0")):
    time.sleep(3600)  # the worker that hangs before it logs anything more
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), sys.exit(0)))


class Handler(BaseHTTPRequestHandler):
    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({{}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply({{"choices": [{{"text": "x", "token_ids": [1]}}]}})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
"""


def test_a_close_while_a_restart_stops_the_engine_leaves_nothing_running(tmp_path: Path) -> None:
    """A gateway shutting down (close) while its monitor restarts a replica: the restart's start comes
    after the close and must not leave an engine behind (it did: a vLLM outlived the test suite)."""
    import subprocess
    import sys
    import threading
    import time

    fake = tmp_path / "fake-vllm-python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    proc = VLLMProcess(VLLMProcessConfig(python=fake, served_model_name="tiny", log_file=tmp_path / "vllm.log"))
    proc.start(tmp_path / "model")
    first = proc.pids()
    assert first

    raised: list[BaseException] = []

    def restart() -> None:
        try:
            proc.restart()
        except BaseException as e:  # noqa: BLE001 - what the monitor would see
            raised.append(e)

    restarting = threading.Thread(target=restart)
    restarting.start()
    time.sleep(0.3)  # the restart is stopping the engine (it takes a second to go)
    proc.close()
    restarting.join(30)
    left = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True).stdout.split()
    assert not left, f"an engine outlived close(): pids {left}"
    assert len(raised) == 1 and isinstance(raised[0], EngineStartError) and "closed" in str(raised[0])
    with pytest.raises(EngineStartError, match="was closed"):
        proc.start(tmp_path / "model")


def _fake_vllm(tmp_path: Path, monkeypatch, hangs: int, **config) -> VLLMProcess:
    import sys

    fake = tmp_path / "fake-vllm-python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.setenv("FAKE_VLLM_HANGS", str(hangs))
    return VLLMProcess(
        VLLMProcessConfig(
            python=fake, served_model_name="tiny", log_file=tmp_path / "vllm.log", stop_grace_s=2, **config
        )
    )


def test_a_start_whose_log_stays_silent_is_started_again_once(tmp_path: Path, monkeypatch, caplog) -> None:
    proc = _fake_vllm(tmp_path, monkeypatch, hangs=1, start_stall_s=3, start_timeout_s=60)
    with proc:
        proc.start(tmp_path / "model")
        assert proc.alive()
    assert (tmp_path / "model" / "starts").read_text() == "2"
    log_text = (tmp_path / "vllm.log").read_text()
    assert log_text.count("=== posttrain: starting vLLM") == 2 and "fake vLLM start 2" in log_text
    assert any("was silent for 3 s while starting; starting it again" in r.getMessage() for r in caplog.records)
    assert proc.pids() == []


def test_a_second_silent_start_is_waited_for_until_the_timeout(tmp_path: Path, monkeypatch) -> None:
    proc = _fake_vllm(tmp_path, monkeypatch, hangs=2, start_stall_s=2, start_timeout_s=8)
    with pytest.raises(EngineStartError, match="not ready after 8 s"):
        proc.start(tmp_path / "model")
    assert (tmp_path / "model" / "starts").read_text() == "2"  # one more start, not a third
    assert proc.pids() == []
