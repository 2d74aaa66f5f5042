"""Flow settings fail early, naming the field; round bookkeeping; which completion errors are transient."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from posttrain.pipeline.settings import GrpoSettings, NightlySettings, flow_run_name
from posttrain.pipeline.tasks.retry import is_transient
from posttrain.rollouts.client import CompletionsError, CompletionsUnavailable
from posttrain.rollouts.rounds import pooled_rewards, round_prompts, shard_specs
from posttrain.rollouts.shard import ShardResult

BASE = dict(run_name="nightly", base_model="/m", dataset="/d.jsonl", shared_dir="/shared")
TRAINER = {"reward_funcs": ["posttrain.rewards:format_reward"], "max_steps": 2}


@pytest.mark.parametrize("changes,field,message", [
    ({"trainer": {**TRAINER, "max_steps": 0}}, "trainer", "trainer.max_steps"),
    ({"trainer": {**TRAINER, "learning_rate": -1}}, "trainer", "trainer.learning_rate"),
    ({"trainer": {"max_steps": 2}}, "trainer.reward_funcs", "Field required"),
    ({"trainer": {**TRAINER, "reward_funcs": []}}, "trainer.reward_funcs", "at least 1 item"),
    ({"trainer": {**TRAINER, "lr": 1}}, "trainer.lr", "Extra inputs"),
    ({"trainer": TRAINER, "cluster": "foo"}, "cluster", "pattern"),
    ({"trainer": TRAINER, "run_name": "Nightly_Run"}, "run_name", "lowercase"),
    ({"trainer": TRAINER, "shared_dir": "relative/dir"}, "shared_dir", "absolute"),
])
def test_nightly_settings_name_the_bad_field(changes, field, message):
    with pytest.raises(ValidationError) as e:
        NightlySettings(**{**BASE, **changes})
    text = str(e.value)
    assert field in text and message in text


def test_grpo_needs_an_inference_deployment_and_a_valid_step():
    with pytest.raises(ValidationError, match="inference"):
        GrpoSettings(**BASE, inference=None)
    with pytest.raises(ValidationError, match="trainer.epsilon"):
        GrpoSettings(**BASE, trainer={"epsilon": 2})
    assert GrpoSettings(**BASE).trainer.learning_rate == 1e-6  # step mode needs no settings: TRL's defaults


GRPO = {**BASE, "run_name": "grpo", "inference": "posttrain-inference-deployment/default"}


def test_grpo_shards_run_on_threads_or_on_dask():
    assert GrpoSettings(**GRPO).task_runner == "threads"
    dask = GrpoSettings(**GRPO, task_runner="dask", dask_address="tcp://10.0.0.5:8786")
    assert dask.dask_address == "tcp://10.0.0.5:8786" and dask.dask_workers is None
    assert GrpoSettings(**GRPO, task_runner="dask", dask_workers=4).dask_workers == 4


@pytest.mark.parametrize("changes,message", [
    ({"task_runner": "ray"}, "'threads' or 'dask'"),
    ({"dask_address": "tcp://10.0.0.5:8786"}, "dask_address: only with task_runner dask"),
    ({"dask_workers": 2}, "dask_workers: only with task_runner dask"),
    ({"task_runner": "dask", "dask_address": "10.0.0.5:8786"}, "pattern"),  # no protocol
    ({"task_runner": "dask", "dask_address": "tcp://10.0.0.5:8786\n"}, "pattern"),
    ({"task_runner": "dask", "dask_workers": 0}, "greater than or equal to 1"),
    ({"task_runner": "dask", "dask_address": "tcp://h:8786", "dask_workers": 2}, "one or the other"),
])
def test_grpo_dask_settings_are_checked(changes, message):
    with pytest.raises(ValidationError, match=message):
        GrpoSettings(**GRPO, **changes)


def test_asynchronous_rounds_are_the_flows_max_staleness_for_a_resident_trainer():
    assert GrpoSettings(**GRPO).max_staleness == 0  # synchronous rounds unless asked
    assert GrpoSettings(**GRPO, max_staleness=2).max_staleness == 2
    assert "max_staleness" not in GrpoSettings.model_fields["trainer"].annotation.model_fields  # one knob
    with pytest.raises(ValidationError, match="max_staleness: asynchronous rounds need trainer_job resident"):
        GrpoSettings(**GRPO, max_staleness=1, trainer_job="per_round")
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        GrpoSettings(**GRPO, max_staleness=-1)


def test_the_shard_runner_is_the_flows_own_or_a_dask_one():
    from prefect_dask import DaskTaskRunner

    from posttrain.pipeline.tasks.rollouts import shard_runner

    with shard_runner("threads") as runner:
        assert runner is None  # the flow's task runner: rollout_shard_task.map as before
    # Neither connects nor starts a cluster before the first shard is submitted.
    with shard_runner("dask", dask_address="tcp://127.0.0.1:8786") as runner:
        assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://127.0.0.1:8786"
        assert runner._client is None  # noqa: SLF001
    with shard_runner("dask", dask_workers=3) as runner:
        assert runner.address is None and runner.cluster_kwargs["n_workers"] == 3
        assert runner.cluster_kwargs["processes"] is True


def test_for_flow_run_gives_each_run_its_own_name():
    s = NightlySettings(**BASE, trainer=TRAINER)
    a, b = s.for_flow_run("0729d8b7-1111-2222"), s.for_flow_run("ffee0000-1111-2222")
    assert a.run_name == "nightly-0729d8b7" and a.run_dir == Path("/shared/runs/nightly-0729d8b7")
    assert b.run_dir != a.run_dir and s.for_flow_run("0729d8b7-1111-2222") == a


def _named(monkeypatch, flow_run_id: str, scheduled: datetime, run_name: str = "nightly") -> str:
    """flow_run_name() as the engine calls it in a flow run of this id, start time and run name."""
    from prefect.runtime import flow_run

    for attr, value in (("id", flow_run_id), ("scheduled_start_time", scheduled),
                        ("parameters", {**BASE, "run_name": run_name}), ("flow_name", "nightly-post-training")):
        monkeypatch.setattr(flow_run, attr, value, raising=False)
    return flow_run_name()


def test_flow_run_names_tell_the_runs_of_a_day_apart_and_match_their_run_folders(monkeypatch):
    day = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
    first = _named(monkeypatch, "0729d8b7-1111-2222-3333-444455556666", day)
    second = _named(monkeypatch, "ffee0000-1111-2222-3333-444455556666", day.replace(hour=9))
    assert (first, second) == ("nightly-2026-12-01-0729d8b7", "nightly-2026-12-01-ffee0000")
    # the short id is the one of the run's folder and jobs
    folder = NightlySettings(**BASE, trainer=TRAINER).for_flow_run("0729d8b7-1111-2222-3333-444455556666").run_dir
    assert folder.name == "nightly-0729d8b7" and first.endswith(folder.name.removeprefix("nightly"))
    # a retry is the same flow run (id, expected start): named again, later, it keeps its name
    assert _named(monkeypatch, "0729d8b7-1111-2222-3333-444455556666", day) == first


def test_round_prompts_wrap_and_shards_cover_them(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(5)]
    assert [r["prompt"][0]["content"] for r in round_prompts(rows, 1, 4)] == ["4", "0", "1", "2"]
    specs = shard_specs(rows, round=2, per_round=5, shards=3, policy_version=2, round_dir=tmp_path)
    assert sorted(r["prompt"][0]["content"] for s in specs for r in s.rows) == ["0", "1", "2", "3", "4"]
    assert [s.out_path.name for s in specs] == ["shard-000.jsonl", "shard-001.jsonl", "shard-002.jsonl"]
    assert all(s.policy_version == 2 for s in specs)


def test_pooled_rewards_match_the_rewards_taken_together():
    groups = [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0], [0.0, 0.0, 0.0]]

    def result(values, shard):
        m = sum(values) / len(values)
        sd = math.sqrt(sum((v - m) ** 2 for v in values) / len(values))
        return ShardResult(round=0, shard=shard, path=Path("x"), samples=len(values), reward_mean=m, reward_std=sd,
                           advantage_abs_mean=0, policy_version=0, seconds=0)

    n, mean, std, spread = pooled_rewards([result(g, i) for i, g in enumerate(groups)])
    flat = [v for g in groups for v in g]
    m = sum(flat) / len(flat)
    assert n == 9 and mean == pytest.approx(m)
    assert std == pytest.approx(math.sqrt(sum((v - m) ** 2 for v in flat) / len(flat)))
    assert spread > 0


def test_only_unavailable_deployments_are_retried():
    assert is_transient(CompletionsUnavailable("failed after 5 attempts (HTTP 503)"))
    assert not is_transient(CompletionsError("HTTP 401: unauthorized"))
    assert is_transient(ConnectionError("reset"))
    assert not is_transient(ValueError("bad"))
