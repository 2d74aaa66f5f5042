"""Commands that talk to a Prefect server, run with PREFECT_API_URL pointing at nothing: one line
naming the URL (its userinfo masked), exit status 2, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args", [["prefect-setup"]])
def test_a_dead_prefect_api_url_is_one_line_naming_it(args):
    port = _closed_port()
    env = {**os.environ, "PREFECT_API_URL": f"http://admin:hunter2-secret@127.0.0.1:{port}/api"}
    run = subprocess.run([sys.executable, "-m", "posttrain", *args], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"posttrain: error: PREFECT_API_URL=http://***@127.0.0.1:{port}/api: "
                               "nothing answers there")
    assert "hunter2" not in run.stderr + run.stdout


@pytest.mark.parametrize("timeout", ["30", "-5", "0"])
def test_a_heartbeat_timeout_the_automation_cannot_take_is_refused_before_any_call(timeout):
    """30 or less marks every healthy run Crashed between two heartbeats (30 s apart); 0 is no "off".
    The option is checked before the server is contacted (it points at nothing here), so nothing
    (block types, pools) is set up first; it was a traceback after the pools, and 0 installed 90 s."""
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{_closed_port()}/api"}
    run = subprocess.run([sys.executable, "-m", "posttrain", "prefect-setup", "--heartbeat-timeout", timeout],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == (f"posttrain: error: --heartbeat-timeout {timeout} s: it must be longer than the "
                                  "30 s between a run's heartbeats, or every healthy run would be marked Crashed "
                                  "(the default is 90 s)")
    assert run.stdout == ""
