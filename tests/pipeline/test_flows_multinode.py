"""Nightly deployment runs training on two Slurm nodes (one slurmd per node name on this host, all at
127.0.0.1; real Prefect server and process worker): TRL GRPO data-parallel across both nodes, every
checkpoint published and hot-loaded, the served weights bit-exactly the last checkpoint's; and a
cancelled run's job is CANCELLED and leaves nothing on either node (the time it took is printed;
the Slurm acceptance asks for 30 s, which a loaded machine can miss, so the test waits up to
CANCEL_WAIT_S for it). (The GRPO step on two nodes: tests/runs/test_training_slurm_2nodes.py.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from posttrain.publish.ledger import Ledger
from posttrain.storage import open_store
from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.runs import run_deployment, wait_final
from tests.pipeline.test_flows_cancel import assert_cancelled, request_cancel, sacct_state, start_long_run
from tests.runs.test_training_slurm_2nodes import job_processes, two_node_cluster

pytestmark = pytest.mark.slow

# How long the cancel test waits for the job to be CANCELLED: 5-25 s on an idle machine, but once
# more than 30 s at load 10 (the worker, the flow's process and scancel all take turns on the CPUs).
CANCEL_WAIT_S = 180


def save_two_node_block(tiny_setup, name: str) -> str:
    from posttrain.cluster import SlurmConfig
    from posttrain.pipeline.blocks import SlurmCluster

    SlurmCluster(settings=SlurmConfig(**two_node_cluster(tiny_setup.root))).save(name, overwrite=True)
    return f"posttrain-slurm-cluster/{name}"


def rank_log(log_path: str, rank: int) -> str:
    path = Path(log_path.replace("_0_log.out", f"_{rank}_log.out"))
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.timeout(420)
@pytest.mark.usefixtures("slurm_cluster_2nodes")
def test_nightly_run_trains_on_two_slurm_nodes_and_serves_the_last_checkpoint(process_worker, tiny_setup):
    from posttrain.runs.once import JobRecord

    cluster = save_two_node_block(tiny_setup, "flows-2nodes")
    proc, flow_run_id = run_deployment(NIGHTLY, tiny_setup.settings("flows-2nodes", cluster=cluster), timeout=300)
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    run = wait_final(flow_run_id)
    assert run.state.is_completed(), (f"{run.state_name}: {run.state.message}\n--- CLI\n{proc.stdout[-3000:]}"
                                      f"\n--- worker\n{process_worker.tail()}")
    run_name = f"flows-2nodes-{flow_run_id.replace('-', '')[:8]}"
    run_dir = tiny_setup.shared_dir / "runs" / run_name
    job = JobRecord.model_validate_json((run_dir / "training-job.json").read_text())
    assert job.backend == "slurm"
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job.job_id, "-o", "NNodes,NodeList,State"],
                           capture_output=True, text=True).stdout.split()
    assert sacct == ["2|n[1-2]|COMPLETED"], sacct
    logs = [rank_log(job.log_path, r) for r in (0, 1)]
    assert "distributed: rank 0 of world size 2 (node rank 0" in logs[0] and "(Slurm node n1)" in logs[0]
    assert "distributed: rank 1 of world size 2 (node rank 1" in logs[1] and "(Slurm node n2)" in logs[1]

    store = open_store(str(tiny_setup.store))
    try:
        entries = Ledger(store, run_name).entries()
    finally:
        store.close()
    assert [(e.step, e.kind) for e in entries] == [(1, "full"), (2, "delta")]
    assert tiny_setup.served_identity() == entries[-1].identity
    assert_served_bit_exactly(tiny_setup, run_dir / "output" / "checkpoint-2")  # the last checkpoint's weights


def assert_served_bit_exactly(tiny_setup, checkpoint: Path) -> None:
    import torch
    from safetensors.torch import load_file

    served = tiny_setup.server.engine.slot.current().model.state_dict()
    trained = load_file(str(checkpoint / "model.safetensors"))
    assert trained and set(trained) <= set(served)
    for name, tensor in trained.items():
        assert torch.equal(served[name].cpu(), tensor), name


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("slurm_cluster_2nodes")
def test_cancelling_a_two_node_run_leaves_nothing_on_either_node(process_worker, tiny_setup):
    cluster = save_two_node_block(tiny_setup, "flows-cancel-2nodes")
    flow_run_id, job = start_long_run(tiny_setup, process_worker, "flows-cancel-2nodes", cluster=cluster)
    assert job.backend == "slurm"
    job_dir = str(Path(job.log_path).parent)
    deadline = time.monotonic() + 120
    while not all("distributed: rank" in rank_log(job.log_path, r) for r in (0, 1)):  # training on both nodes
        assert time.monotonic() < deadline, f"not training on both nodes in 120 s: {sacct_state(job.job_id)}"
        time.sleep(0.5)
    assert job_processes(job_dir)

    t0 = request_cancel(flow_run_id)
    while not sacct_state(job.job_id).startswith("CANCELLED"):
        assert time.monotonic() - t0 < CANCEL_WAIT_S, \
            f"job {job.job_id} {sacct_state(job.job_id)} {CANCEL_WAIT_S} s after cancelling"
        time.sleep(0.5)
    cancelled_s = time.monotonic() - t0
    while job_processes(job_dir):  # scancel ends every process of both nodes' steps
        assert time.monotonic() - t0 < cancelled_s + 60, f"left on the nodes: {job_processes(job_dir)}"
        time.sleep(0.2)
    gone_s = time.monotonic() - t0
    assert_cancelled(flow_run_id, job, f"slurm job {job.job_id} cancelled (scancel")
    steps = subprocess.run(["sacct", "-n", "-P", "-j", job.job_id, "-o", "JobID,NodeList,State"],
                           capture_output=True, text=True).stdout.split()
    assert any("n[1-2]" in s for s in steps), steps
    print(f"2-node Slurm job CANCELLED {cancelled_s:.1f} s, no process left on either node {gone_s:.1f} s "
          "after the cancel request")
