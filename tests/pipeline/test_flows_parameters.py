"""Run parameters as a Prefect user gives them, through the real server and process worker: what
the schema cannot check (blocks, reward functions, paths that do not exist) fails the run before anything is submitted,
naming the parameter. (``--param`` changing exactly that setting of the job, the deployment's
values holding for the rest: test_flows_concurrency.py, on the run that holds the slot.)"""

from __future__ import annotations

import pytest

from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.runs import run_deployment, wait_final

pytestmark = pytest.mark.slow


def instance(run: str, flow_run_id: str) -> str:
    return f"{run}-{flow_run_id.replace('-', '')[:8]}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("params", "message"), [
    # The UI form's block picker sends a reference to a saved block: accepted by the schema and the
    # flow; the store block named next to it does not exist.
    ({"cluster": {"$ref": {"block_document_slug": "posttrain-local-cluster/default"}},
      "store": "posttrain-object-store/nope"}, "store: cannot load block 'posttrain-object-store/nope'"),
    # Every way a reward function fails to load: tests/rollouts/test_rewards.py.
    ({"reward_funcs": ["posttrain.rewards:nope"]},
     "reward_funcs[0] 'posttrain.rewards:nope': 'posttrain.rewards' has no function 'nope'"),
    # An absolute path that does not exist passes the schema; inside the job it was an OSError about
    # repo ids, after a queue slot.
    ({"base_model": "/nonexistent/models/base"},
     "base_model: /nonexistent/models/base does not exist (checked on this machine"),
], ids=["picked-cluster-block-missing-store", "unknown-reward-function", "base-model-path-missing"])
def test_what_the_schema_cannot_check_fails_before_submitting(process_worker, tiny_setup, params, message):
    proc, flow_run_id = run_deployment(NIGHTLY, tiny_setup.settings("flows-early", **params))
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    run = wait_final(flow_run_id)
    assert run.state.is_failed(), f"{run.state_name}: {run.state.message}"
    assert message in run.state.message
    name = instance("flows-early", flow_run_id)
    assert not (tiny_setup.shared_dir / "runs" / name / "training-job.json").exists()
    assert not (tiny_setup.jobs_dir.exists() and list(tiny_setup.jobs_dir.glob(f"{name}*")))
