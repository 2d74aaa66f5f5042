"""A new user's afternoon, replayed (issue 21's trial): scripts/site-trial.sh runs the setup steps of
docs/site-setup.md from a fresh clone against a Prefect server of its own on a non-default port,
checks each (one-line mistakes, blocks, deploy, a run with one parameter changed, a cancel, the
chain commands) and stops what it started. With --slurm it replays the page's Slurm path with the
page's own values (read from its code blocks) on the test suite's Slurm cluster."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.services, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(900)
def test_the_site_setup_steps_run_as_written_from_a_fresh_clone(tmp_path):
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: nothing to clone")
    env = {**os.environ, "TRIAL_PORT": str(_free_port()), "TRIAL_DIR": str(tmp_path / "trial")}
    env.pop("PREFECT_API_URL", None)  # the trial's own server, never the suite's
    run = subprocess.run(["bash", str(REPO / "scripts" / "site-trial.sh")], env=env, capture_output=True, text=True,
                         timeout=840)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
    assert "[site-trial] PASSED" in run.stdout
    print(run.stdout)


@pytest.mark.timeout(900)
def test_the_site_setup_slurm_path_runs_with_the_pages_own_values(tmp_path, slurm_cluster):
    """docs/site-setup.md deployed base_model /shared/models/base with a Slurm block whose shared_dir
    was /mnt/shared: the run staged the dataset, then failed at submit (issue 37). The trial runs
    the page's values as written: /shared is made a link to the trial's folder (root only)."""
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: nothing to clone")
    if os.geteuid() != 0:
        pytest.skip("the Slurm trial makes the page's /shared: root only")
    if os.path.lexists("/shared") and os.path.exists("/shared"):
        pytest.skip("/shared exists on this machine: the Slurm trial would make it")
    env = {**os.environ, "TRIAL_PORT": str(_free_port()), "TRIAL_DIR": str(tmp_path / "trial")}
    env.pop("PREFECT_API_URL", None)  # the trial's own server, never the suite's
    run = subprocess.run(["bash", str(REPO / "scripts" / "site-trial.sh"), "--slurm"], env=env, capture_output=True,
                         text=True, timeout=840)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
    for step in ("deployed with the suggested command: prefect --no-prompt deploy --name nightly --name grpo "
                 "--name promote --name rollback",
                 "fails before staging, naming base_model and shared_dir",
                 "the page's run on its Slurm block completed", "[site-trial] PASSED"):
        assert step in run.stdout, step
    assert not os.path.lexists("/shared")  # the trial's link is gone
    print(run.stdout)
