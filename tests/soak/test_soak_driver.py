"""The soak driver's parts that need no services: the seeded schedule (replayable, every kind at
least once, durations within the issue's bounds), ``--dry-run`` and ``--help``, the store's switchable
proxy, and the recorder's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from posttrain.testing.soak import FILES, KINDS, OUTAGE_MODES, ROLES
from posttrain.testing.soak.processes import Supervised, alive
from posttrain.testing.soak.proxy import StoreFront
from posttrain.testing.soak.record import Recorder
from posttrain.testing.soak.schedule import DURATIONS, plan, plan_faults, plan_operator

REPO = Path(__file__).resolve().parents[2]
SOAK = REPO / "bench" / "soak.py"


@pytest.mark.parametrize("minutes", [1, 3, 10, 60])
def test_the_schedule_is_a_function_of_the_seed_and_has_every_kind(minutes):
    a, b, other = plan_faults(7, minutes), plan_faults(7, minutes), plan_faults(8, minutes)
    assert a == b and a != other
    assert set(KINDS) <= {f.kind for f in a}
    times = [f.at_s for f in a]
    assert times == sorted(times) and 0 < times[0] and times[-1] < minutes * 60
    for f in a:
        low, high = DURATIONS[f.kind]
        assert low <= f.duration_s <= high
        assert f.target in {"store_outage": OUTAGE_MODES, "serve_kill": ROLES, "trainer_kill": ("nightly", "grpo"),
                            }.get(f.kind, (f.target,))


def test_an_hour_has_fifty_faults_and_full_length_outages():
    faults = plan_faults(1, 60)
    assert len(faults) >= 50
    outages = [f.duration_s for f in faults if f.kind == "store_outage"]
    assert outages and all(10 <= d <= 120 for d in outages)
    assert plan_faults(1, 3)[-1].at_s < 3 * 60 * 0.8  # the end of a short soak is left for the drain


def test_the_operator_rolls_back_and_promotes_at_seeded_times():
    actions = plan_operator(3, 3)
    assert actions == plan_operator(3, 3)
    assert {a.action for a in actions} == {"rollback", "promote"}
    assert [a.at_s for a in actions] == sorted(a.at_s for a in actions)
    assert plan(3, 3, 90).nights == 2 and plan(3, 60, 90).nights == 40


def test_dry_run_prints_the_schedule_and_starts_nothing():
    run = subprocess.run([sys.executable, str(SOAK), "--minutes", "3", "--seed", "1", "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [(x["at_s"], x["kind"], x["target"], x["duration_s"]) for x in lines] == [
        (f.at_s, f.kind, f.target, f.duration_s) for f in plan_faults(1, 3)]
    assert "soak seed 1: 3 min" in run.stdout
    again = subprocess.run([sys.executable, str(SOAK), "--minutes", "3", "--seed", "1", "--dry-run"],
                           capture_output=True, text=True, timeout=60)
    assert again.stdout == run.stdout


def test_help_explains_every_knob():
    run = subprocess.run([sys.executable, str(SOAK), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    for knob in ("--minutes", "--seed", "--backend", "--out", "--night-s", "--drain-s", "--spool-mib", "--dry-run"):
        assert knob in run.stdout
    bad = subprocess.run([sys.executable, str(SOAK), "--minutes", "0", "--seed", "1"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _get(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return type(e.reason if isinstance(e, urllib.error.URLError) else e).__name__


def test_the_store_front_refuses_throttles_and_comes_back_on_its_port(upstream):
    front = StoreFront(upstream)
    try:
        url = f"{front.url}/bucket/key"
        assert _get(url) == 200
        front.begin("503")
        assert _get(url) == 503
        front.end("503")
        assert _get(url) == 200
        port = front.port
        front.begin("refused")
        assert _get(url) == "ConnectionRefusedError"
        front.end("refused")
        assert front.port == port and _get(url) == 200
        assert front.counters()["503"] == 1
    finally:
        front.stop()


def test_the_recorder_writes_each_line_as_it_happens(tmp_path):
    rec = Recorder(tmp_path)
    rec.write("faults", {"kind": "serve_kill"})
    assert json.loads((tmp_path / "faults.jsonl").read_text()) == {"kind": "serve_kill"}  # before close
    rec.write_json("soak.json", {"seed": 1})
    rec.close()
    assert {p.name for p in tmp_path.iterdir()} >= set(FILES)


def test_a_killed_process_is_started_again_by_its_supervisor(tmp_path):
    events: list[str] = []
    proc = Supervised("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "sleeper.log",
                      env=dict(os.environ), cwd=tmp_path, on_event=events.append)
    proc.start()
    try:
        first = proc.proc.pid
        assert proc.kill(0.2) == [first]
        deadline = time.monotonic() + 60
        while proc.starts < 2:
            assert time.monotonic() < deadline, events
            time.sleep(0.1)
        assert proc.proc.pid != first and alive(proc.proc.pid)
    finally:
        proc.stop()
    assert not alive(proc.proc.pid) and any("exited rc -9" in e for e in events), events


def test_trainer_kill_tells_the_run_kind_from_a_cut_job_folder_name():
    from posttrain.testing.soak.faults import _kind_of

    name = "soak-2-1203161602"
    assert _kind_of(f"python -m posttrain.trainer /w/jobs/{name}-nigh-3784b7ce-20261203/trainer.yaml", name) == "nightly"
    assert _kind_of(f"python -m posttrain.trainer /w/jobs/{name}-grpo-1a2b3c4d-20261203/trainer.yaml", name) == "grpo"
    assert _kind_of("python -m posttrain.trainer /elsewhere/trainer.yaml", name) is None


def test_the_client_records_every_reply_on_its_thread_and_stops(tmp_path):
    """The client (a Background actor like the nights, the operator and the injector) asks on its own
    thread until stopped, and records every request, a failed one with status 0 and its error."""
    import socket
    import time

    from posttrain.testing.soak.client import Client
    from posttrain.testing.soak.record import Recorder

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = Recorder(tmp_path)
    client = Client(rec, f"http://127.0.0.1:{port}", "t", "tiny", interval_s=0.05)
    client.start()
    deadline = time.monotonic() + 60
    while client.sent < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    client.stop()
    sent = client.sent
    time.sleep(0.2)
    assert sent >= 3 and client.sent == sent and not client._thread.is_alive()  # stopped for good
    rec.close()
    rows = [json.loads(line) for line in (tmp_path / "replies.jsonl").read_text().splitlines()]
    assert len(rows) == sent and all(r["status"] == 0 and r["error"] for r in rows)


def test_a_background_actor_waits_for_its_time_unless_stopped():
    import time

    from posttrain.testing.soak.record import Background

    actor = Background("t", t0=time.monotonic())
    t = time.monotonic()
    assert actor._until(0.2) is False and time.monotonic() - t >= 0.19
    actor.stopping.set()
    assert actor._until(3600) is True  # at once


def test_the_slurm_backend_trains_each_kind_on_a_valid_block_of_its_own(tmp_path):
    """--backend slurm (not run end to end in the suite): each kind's cluster block is a SlurmConfig that
    validates, whose shared storage holds the soak's folder and whose job root is the one trainer_kill
    searches; the local backend keeps one local cluster."""
    from posttrain.cluster import SlurmConfig
    from posttrain.testing.soak.record import Recorder
    from posttrain.testing.soak.system import System

    slurm = System(seed=1, root=tmp_path / "work", rec=Recorder(tmp_path / "out"), backend="slurm")
    assert slurm.cluster("nightly") != slurm.cluster("grpo")  # their jobs may run at once
    assert all(slurm.cluster(k).startswith("posttrain-slurm-cluster/") for k in ("nightly", "grpo"))
    config = SlurmConfig(**slurm._slurm_settings())
    assert config.shared_dir == str(slurm.root) and config.job_root == str(slurm.jobs)
    assert config.nodes == 1 and config.gpus_per_node == 0 and config.launcher == "python"
    local = System(seed=1, root=tmp_path / "work2", rec=Recorder(tmp_path / "out2"))
    assert local.cluster("nightly") == local.cluster("grpo") == f"posttrain-local-cluster/{local.name}"


def test_a_store_that_does_not_answer_is_a_one_line_setup_error_without_its_password(monkeypatch) -> None:
    from types import SimpleNamespace

    from posttrain.testing.soak.system import System

    monkeypatch.setenv("POSTTRAIN_S3_ENDPOINT", "http://ops:s3cret-pw@127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "soak")  # as System.start sets them
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "soak")
    with pytest.raises(RuntimeError, match="POSTTRAIN_S3_ENDPOINT=.* does not answer: start the services") as e:
        System._bucket(SimpleNamespace(name="soak-test"))
    assert "s3cret-pw" not in str(e.value) and "\n" not in str(e.value)
