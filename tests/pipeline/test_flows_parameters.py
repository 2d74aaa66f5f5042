"""Run parameters as a Prefect user gives them, through the real server and process worker: one
``--param`` changes exactly that setting of the job, the deployment's defaults hold for the rest,
and what the schema cannot check (blocks, reward functions) fails the run before anything is
submitted, naming the parameter."""

from __future__ import annotations

import re
import time

import pytest
import yaml

from posttrain.runs.once import JobRecord
from posttrain.trainer.config import TrainerConfig
from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.runs import REPO, prefect_cli, read_flow_run, run_deployment, wait_final

pytestmark = pytest.mark.slow


def instance(run: str, flow_run_id: str) -> str:
    return f"{run}-{flow_run_id.replace('-', '')[:8]}"


@pytest.mark.timeout(300)
def test_one_param_changes_exactly_that_field_of_the_job(process_worker, tiny_setup):
    proc = prefect_cli("deployment", "run", NIGHTLY, "--param", "learning_rate=5e-5")
    out = proc.stdout + proc.stderr
    match = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert proc.returncode == 0 and match, out
    flow_run_id = match.group(1)
    try:
        run = read_flow_run(flow_run_id)
        deployment = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"][0]
        assert set(run.parameters) == set(deployment["parameters"]) | {"learning_rate"}
        marker = tiny_setup.shared_dir / "runs" / instance("nightly", flow_run_id) / "training-job.json"
        deadline = time.monotonic() + 120
        while not marker.exists():
            state = read_flow_run(flow_run_id).state
            assert not state.is_final(), f"{state.name}: {state.message}\n{process_worker.tail()}"
            assert time.monotonic() < deadline, f"no training job submitted in 120 s\n{process_worker.tail()}"
            time.sleep(0.5)
        job = JobRecord.model_validate_json(marker.read_text())
        received = yaml.safe_load((REPO / job.log_path).parent.joinpath("trainer.yaml").read_text())
    finally:
        prefect_cli("flow-run", "cancel", flow_run_id)
    wait_final(flow_run_id, timeout=60)

    # The job's trainer config: the one parameter, the deployment's values, TRL's defaults for the rest.
    run_dir = tiny_setup.shared_dir / "runs" / instance("nightly", flow_run_id)
    expected = TrainerConfig(
        mode="grpo", model_name_or_path=str(tiny_setup.base_model), output_dir=run_dir / "output",
        dataset_manifest=received["dataset_manifest"],
        reward_funcs=["posttrain.rewards:correctness_reward"], max_steps=100, save_steps=10,  # prefect.yaml
        learning_rate=5e-5,  # the --param
    )
    assert TrainerConfig.model_validate(received) == expected
    assert received["learning_rate"] == 5e-5 and received["max_steps"] == 100


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("params", "message"), [
    ({"store": "posttrain-object-store/nope"}, "store: cannot load block 'posttrain-object-store/nope'"),
    # The UI form's block picker sends a reference to a saved block: accepted by the schema and the flow.
    ({"cluster": {"$ref": {"block_document_slug": "posttrain-local-cluster/default"}},
      "store": "posttrain-object-store/nope"}, "store: cannot load block 'posttrain-object-store/nope'"),
    ({"reward_funcs": ["posttrain.rewards:nope"]},
     "reward_funcs[0] 'posttrain.rewards:nope': 'posttrain.rewards' has no function 'nope'"),
    ({"reward_funcs": ["posttrain.nowhere:reward"]}, "reward_funcs[0] 'posttrain.nowhere:reward': cannot import"),
], ids=["missing-store-block", "picked-cluster-block", "unknown-reward-function", "unknown-reward-module"])
def test_what_the_schema_cannot_check_fails_before_submitting(process_worker, tiny_setup, params, message):
    proc, flow_run_id = run_deployment(NIGHTLY, tiny_setup.settings("flows-early", **params))
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    run = wait_final(flow_run_id)
    assert run.state.is_failed(), f"{run.state_name}: {run.state.message}"
    assert message in run.state.message
    name = instance("flows-early", flow_run_id)
    assert not (tiny_setup.shared_dir / "runs" / name / "training-job.json").exists()
    assert not (tiny_setup.jobs_dir.exists() and list(tiny_setup.jobs_dir.glob(f"{name}*")))
