"""The short soak: ``bench/soak.py --minutes 3 --seed 1`` in the test command, one fault of each kind
at least, a soak folder that holds everything the contract (``posttrain.testing.soak``) promises,
and no violation: the soak runs the independent checker at its end (exit status 4 on a violation).

It runs beside the other tests: its Prefect server and PostgreSQL are its own (``--services own``),
so its restart faults meet no other test; SeaweedFS is shared (a bucket of its own, its outages
through its own proxy). Alone: ``PYTEST_ARGS="tests/soak/test_short_soak.py" bash scripts/test.sh``.
Skipped only where the tmpfs its spool faults fill cannot be mounted (not root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.testing.soak import FILES, KINDS, ROLES

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _rows(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.timeout(2400)
def test_a_three_minute_soak_runs_to_its_end_and_leaves_a_complete_folder(tmp_path):
    for var in ("PREFECT_API_URL", "POSTTRAIN_S3_ENDPOINT"):
        assert os.environ.get(var), f"{var} is unset: run with the services' environment (scripts/test.sh)"
    out = tmp_path / "soak"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--minutes", "3", "--seed", "1",
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=2300)
    checked = (out / "check.txt").read_text() if (out / "check.txt").exists() else "(no check.txt)"
    assert run.returncode == 0, f"exit status {run.returncode}\n{checked[-6000:]}\n{run.stderr[-3000:]}"
    assert {p.name for p in out.iterdir()} >= set(FILES) | {"logs"}
    meta = json.loads((out / "soak.json").read_text())
    assert meta["services"] == "own" and meta["prefect_api_url"] != os.environ["PREFECT_API_URL"]
    assert meta["seed"] == 1 and meta["ended_at"] and meta["max_staleness"] == 1
    assert meta["store"]["endpoint_url"] == os.environ["POSTTRAIN_S3_ENDPOINT"] and meta["store"]["bucket"]
    assert set(meta["deployments"]) == set(ROLES)
    assert meta["deployments"]["production"]["history"]["deployment"] == meta["deployments"]["production"][
        "deployment_id"]
    assert all(Path(d).is_dir() for d in meta["run_dirs"])

    planned = _rows(out, "schedule")
    assert {f["kind"] for f in planned} == set(KINDS)
    faults = _rows(out, "faults")
    assert len(faults) == len(planned)
    assert {f["kind"] for f in faults if f["injected"]} == set(KINDS), faults  # each kind injected, not only planned
    runs = _rows(out, "runs")
    assert {r["kind"] for r in runs} == {"nightly", "grpo"}
    assert {r["action"] for r in _rows(out, "operator")} >= {"gc", "rollback", "promote"}
    replies = _rows(out, "replies")
    assert replies and any(r["status"] == 200 for r in replies)
    assert all(r["temperature"] == 0.0 for r in replies)
    print(json.dumps(meta["summary"], indent=1))
