"""The launcher probe against a real Slurm (the slurm_cluster fixture: nodes on this host): one
srun task runs the job's env and setup_commands, then looks the launcher up on the node's PATH."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from posttrain.cluster import ConfigError, SlurmConfig
from posttrain.cluster import preflight

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def _config(shared: Path, **change) -> SlurmConfig:
    return SlurmConfig(**{"shared_dir": str(shared), "python": sys.executable, "nodes": 1, "gpus_per_node": 0,
                          "memory": "500M", "exclusive": False, "time_limit": "10", "launcher": "torchrun",
                          "poll_interval_s": 1, **change})


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    monkeypatch.setattr(preflight, "_probed", {})


def test_the_probe_finds_torchrun_put_on_the_path_by_setup_commands(tmp_path):
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "torchrun").exists()  # torch's console script, next to the tests' Python
    config = _config(tmp_path, setup_commands=[f"export PATH={venv_bin}:$PATH"])
    t0 = time.monotonic()
    preflight.check_launcher(config)
    took = time.monotonic() - t0
    print(f"srun launcher probe: {took:.2f} s", file=sys.stderr)  # the cost docs/site-setup.md states
    assert list(preflight._probed.values()) == [""], "the probe got no allocation: nothing was checked"
    t0 = time.monotonic()
    preflight.check_launcher(config)  # cached for this process
    assert time.monotonic() - t0 < 0.1


def test_the_probe_names_a_launcher_missing_from_the_nodes(tmp_path):
    config = _config(tmp_path, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    with pytest.raises(ConfigError, match=r"^launcher: torchrun is not on the nodes' PATH \(the default partition"):
        preflight.check_launcher(config)
