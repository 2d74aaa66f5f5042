"""``posttrain serve`` as a process: it starts, serves, hot-loads, stops on SIGTERM, and never prints the token."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.support.serving import DEPLOYMENT, PREFIX, PROMPT, TOKEN

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_end_to_end(chain, tmp_path):
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

    port = _free_port()
    env = {**os.environ, "SERVE_TEST_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "posttrain", "serve", "--model", str(chain.models[0]), "--port", str(port),
           "--deployment-id", DEPLOYMENT, "--store", str(chain.store), "--prefix", PREFIX,
           "--token-env", "SERVE_TEST_TOKEN", "--work-dir", str(tmp_path / "work"), "--served-model-name", "tiny",
           "--device", "cpu", "--log-level", "debug"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if requests.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "posttrain serve did not start"
            time.sleep(0.2)
        assert requests.get(url + "/health", timeout=5).status_code == 401
        body = requests.post(url + "/v1/completions", headers=headers, timeout=30,
                             json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
        assert body["choices"][0]["token_ids"] == chain.greedy[0]
        with CoreWeaveHotLoader(HotLoadConfig(api_url=url, deployment_id=DEPLOYMENT, token=TOKEN,
                                              poll_interval=0.05, timeout=30)) as client:
            client.hot_load(chain.full)
            client.hot_load(chain.d1, base_identity=chain.full)
        body = requests.post(url + "/v1/completions", headers=headers, timeout=30,
                             json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
        assert body["choices"][0]["token_ids"] == chain.greedy[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    output = log_path.read_text()
    assert rc == 0, output
    assert f"on http://127.0.0.1:{port}" in output and "COMPLETED" in output
    assert TOKEN not in output


def test_serve_refuses_to_start_without_a_token(chain, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SERVE_TEST_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "posttrain", "serve", "--model", str(chain.models[0]),
                        "--deployment-id", "d", "--store", str(tmp_path), "--token-env", "SERVE_TEST_TOKEN"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "SERVE_TEST_TOKEN" in r.stderr


def _serve_error(capsys, monkeypatch, chain, tmp_path, *args: str) -> str:
    """Run ``posttrain serve`` in this process with ``args``; the one error line it prints (exit 2)."""
    from posttrain.cli import main

    monkeypatch.setenv("SERVE_TEST_TOKEN", TOKEN)
    fields = {"--model": str(chain.models[0]), "--deployment-id": "d", "--store": str(chain.store),
              "--port": "0", "--work-dir": str(tmp_path / "work")}
    given = dict(zip(args[::2], args[1::2], strict=True))
    argv = ["serve", "--token-env", "SERVE_TEST_TOKEN"] + [x for k, v in {**fields, **given}.items() for x in (k, v)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert TOKEN not in err
    return err.strip()


def test_serve_start_errors_are_one_line_naming_the_setting(capsys, monkeypatch, chain, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--port", str(port))
        assert "--port" in err and f"127.0.0.1:{port}" in err and "in use" in err
    finally:
        busy.close()
    (tmp_path / "empty").mkdir()
    err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--model", str(tmp_path / "empty"))
    assert "--model" in err and "config.json" in err
    (tmp_path / "a-file").write_text("x")
    err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--store", str(tmp_path / "a-file"))
    assert "--store" in err and "is a file" in err
    err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--device", "cuda:7")
    assert "--device" in err and "cuda:7" in err and "CUDA device" in err
    err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--device", "tpu:0")
    assert "--device" in err
    for host in ("0.0.0.0", "10.1.2.3", "example.com"):
        err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--host", host)
        assert "not a loopback address" in err and "--allow-remote" in err


def test_a_missing_vllm_python_is_one_line_naming_engine_python(capsys, monkeypatch, chain, tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--engine", "vllm", "--engine-python", str(missing))
    assert "--engine-python" in err and str(missing) in err


def test_a_vllm_url_that_does_not_answer_is_one_line_naming_engine_url(capsys, monkeypatch, chain, tmp_path):
    port = _free_port()  # nothing listens there
    err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--engine", "vllm",
                       "--engine-url", f"http://127.0.0.1:{port}")
    assert "engine_urls[0]" in err and "--engine-url" in err and f"127.0.0.1:{port}" in err


def test_loopback_hosts_need_no_flag():
    from pydantic import SecretStr

    from posttrain.serve.serve_config import ServeConfig

    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        ServeConfig(model_dir=".", deployment_id="d", store=".", token=SecretStr("t"), host=host)
    assert ServeConfig(model_dir=".", deployment_id="d", store=".", token=SecretStr("t"), host="0.0.0.0",
                       allow_remote=True).host == "0.0.0.0"


def test_the_reference_engine_makes_openmp_threads_sleep_unless_the_user_chose(capsys, monkeypatch, chain, tmp_path):
    """libgomp's threads spin at barriers by default and took the CPU of everything beside a CPU
    server: ``posttrain serve`` asks them to sleep before it builds the server (what the server
    would start with is recorded here), a user's own choice stays, and engines in processes of
    their own are left alone."""
    import posttrain.serve.server
    from posttrain.cli.serve import quiet_openmp

    seen = []

    class Recorder:
        def __init__(self, config):
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
            raise ValueError("recorded")

    monkeypatch.setattr(posttrain.serve.server, "InferenceServer", Recorder)
    # set, then unset: monkeypatch then restores the variable after the test even where it was
    # absent (a bare delenv of an absent one records nothing, and the PASSIVE set by the server leaks)
    monkeypatch.setenv("OMP_WAIT_POLICY", "placeholder")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    _serve_error(capsys, monkeypatch, chain, tmp_path)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _serve_error(capsys, monkeypatch, chain, tmp_path)
    assert seen == ["PASSIVE", "ACTIVE"]
    for engine in ("vllm", "sglang"):
        env: dict[str, str] = {}
        quiet_openmp(engine, env)
        assert env == {}, engine


def test_serve_sets_openmp_before_anything_loads_torch():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: everything ``cmd_serve`` imports
    before setting it must leave torch unloaded."""
    script = ("import sys\n"
              "import posttrain.cli.serve, posttrain.redact, posttrain.cli, posttrain.serve.serve_config\n"
              "import pydantic\n"
              "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
              "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_file_given_as_the_work_dir_is_named(capsys, monkeypatch, chain, tmp_path):
    (tmp_path / "a-file").write_text("x")
    err = _serve_error(capsys, monkeypatch, chain, tmp_path, "--work-dir", str(tmp_path / "a-file"))
    assert err == f"posttrain: error: work_dir (--work-dir) {tmp_path / 'a-file'}: is a file, not a folder"


def _start_message(chain, work: Path) -> str:
    """The line ``posttrain serve`` prints when it is up (booted clean or resumed), then stops it."""
    env = {**os.environ, "SERVE_TEST_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", "--model", str(chain.models[0]), "--port",
                             "0", "--deployment-id", DEPLOYMENT, "--store", str(chain.store), "--prefix", PREFIX,
                             "--token-env", "SERVE_TEST_TOKEN", "--work-dir", str(work), "--device", "cpu"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # ends when the process does (a failed start)
            if line.startswith(("posttrain serve: booted clean", "posttrain serve: resumed")):
                return line.strip()
        raise AssertionError(proc.stderr.read())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_recorded_version_that_fails_its_checks_is_named_on_stdout(chain, tmp_path, make_client):
    """The log said the recorded version was refused while stdout said none was recorded."""
    from tests.support.serving import start_server

    work = tmp_path / "work"
    server = start_server(chain, work)
    try:
        make_client(server).hot_load(chain.full)
    finally:
        server.shutdown()
    (rebuilt,) = (work / "models").iterdir()
    shutil.rmtree(rebuilt)  # gone: the record names a folder that fails its checks
    line = _start_message(chain, work)
    assert line == (f"posttrain serve: booted clean on {chain.models[0]} ({chain.full} is recorded in {work} "
                    "but failed its checks and was removed)"), line
    line = _start_message(chain, work)  # nothing recorded now
    assert line == f"posttrain serve: booted clean on {chain.models[0]} (no earlier version recorded in {work})", line


def test_a_config_error_of_two_settings_is_one_line_naming_them(capsys, monkeypatch, chain, tmp_path):
    """A model-level check (two settings together) has no field location: the line is its message,
    which names the settings, without pydantic's "Value error, " (was ``posttrain: error: : Value error, ...``)."""
    from posttrain.cli import main

    monkeypatch.setenv("SERVE_TEST_TOKEN", TOKEN)
    assert main(["serve", "--token-env", "SERVE_TEST_TOKEN", "--model", str(chain.models[0]), "--deployment-id", "d",
                 "--store", str(chain.store), "--port", "0", "--work-dir", str(tmp_path / "work"),
                 "--metrics-no-auth"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("posttrain: error: metrics_no_auth (--metrics-no-auth) is for a separate metrics_port"), err
    assert "Value error" not in err


def test_pydantic_problems_name_the_field_or_are_the_model_checks_message():
    from pydantic import BaseModel, ValidationError, field_validator, model_validator

    from posttrain.errors import describe_validation_error, validation_problems

    class Two(BaseModel):
        a: int = 0
        b: int = 0

        @field_validator("a")
        @classmethod
        def _a(cls, v: int) -> int:
            if v < 0:
                raise ValueError("a must not be negative")
            return v

        @model_validator(mode="after")
        def _both(self):
            if self.a > self.b:
                raise ValueError("a (--a) must not exceed b (--b)")
            return self

    with pytest.raises(ValidationError) as info:
        Two(a=2, b=1)
    assert validation_problems(info.value) == ["a (--a) must not exceed b (--b)"]
    assert describe_validation_error(info.value) == "Two: a (--a) must not exceed b (--b)"
    with pytest.raises(ValidationError) as info:
        Two(a=-1, b="x")
    assert validation_problems(info.value, {"a": "--a"}) == [
        "--a: a must not be negative", "b: Input should be a valid integer, unable to parse string as an integer"]
