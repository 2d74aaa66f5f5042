"""GRPO rollout shards (the ``rollout-shard`` task, mapped): the shards of a round run
concurrently, and a shard that fails with a transient error is retried alone (one run shows both).

The grpo flow runs in this process against the Prefect server; what ran when is read back from
the server (the task runs and their states)."""

from __future__ import annotations

import json

import pytest

from posttrain.pipeline.tasks.report import round_table_rows
from tests.pipeline.flaky import FLAKY_MARKER_ENV, SLOW_SECONDS_ENV
from tests.pipeline.run_events import assert_goodput_adds_up, named, wait_events
from tests.pipeline.runs import assert_one_shard_retried, overlapping, read_flow_run, shard_runs
from tests.support.tensorboard import scalar_curves

pytestmark = pytest.mark.slow


def grpo_settings(setup, run_name: str, *, shards: int, reward_funcs: list[str], trainer_job: str = "resident"):
    from posttrain.pipeline.settings import GrpoSettings

    return GrpoSettings(
        run_name=run_name, base_model=str(setup.base_model), dataset=str(setup.dataset),
        shared_dir=str(setup.shared_dir), rounds=1, prompts_per_round=shards, shards=shards,
        rollout={"num_generations": 2, "max_completion_length": 4, "reward_funcs": reward_funcs},
        trainer={"learning_rate": 1e-3, "use_cpu": True}, trainer_job=trainer_job,
    )


def run_grpo(settings):
    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.parameters import to_parameters

    state = grpo(**to_parameters(settings), return_state=True)
    return state, state.state_details.flow_run_id


def count_tokenizer_loads(monkeypatch) -> list[str]:
    """The folders the rollout shards' tokenizer cache (emptied here) loads, in order."""
    from collections import OrderedDict

    import transformers

    from posttrain.rollouts import tokenizers

    monkeypatch.setattr(tokenizers, "_TOKENIZERS", OrderedDict())
    loads, real = [], transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        loads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return loads


@pytest.mark.timeout(240)
def test_shards_run_concurrently_and_a_failing_one_is_retried_alone(tiny_setup, monkeypatch, tmp_path):
    # Every shard's body lasts >= 3 s (one prompt, a reward function that sleeps), so shards run one
    # after the other would take >= 12 s and never overlap. The first call of flaky_reward, in
    # whichever shard makes it, raises ConnectionError (transient).
    monkeypatch.setenv(SLOW_SECONDS_ENV, "3")
    marker = tmp_path / "flaky-fired"
    monkeypatch.setenv(FLAKY_MARKER_ENV, str(marker))
    loads = count_tokenizer_loads(monkeypatch)
    # per_round: its goodput check below reads a round's step job (queue, start-up, training after sampling).
    state, flow_run_id = run_grpo(grpo_settings(tiny_setup, "flows-grpo-flaky", shards=4,
                                                reward_funcs=["tests.pipeline.flaky:slow_reward",
                                                              "tests.pipeline.flaky:flaky_reward"],
                                                trainer_job="per_round"))
    assert state.is_completed(), state.message
    assert marker.exists()
    assert read_flow_run(flow_run_id).name.startswith("flows-grpo-flaky-")  # named from the run name
    assert loads == [str(tiny_setup.base_model)], loads  # the four shards (and the retry) share one tokenizer load
    assert state.result().rounds[0]["samples"] > 0

    shards = shard_runs(flow_run_id)
    assert sorted(shards) == [f"round-0-shard-{s}" for s in range(4)]
    assert all(r.state.is_completed() for r in shards.values())
    intervals = [(r.start_time.timestamp(), r.end_time.timestamp()) for r in shards.values()]
    spans = {name: f"{r.start_time:%H:%M:%S.%f} .. {r.end_time:%H:%M:%S.%f}" for name, r in shards.items()}
    assert overlapping(intervals) >= 2, f"no two rollout-shard task runs overlap: {spans}"
    # all four started before the first one finished
    assert max(s for s, _ in intervals) < min(e for _, e in intervals), spans

    assert_one_shard_retried(flow_run_id, shards=4)

    # The round still merged all four shards.
    name = f"flows-grpo-flaky-{str(flow_run_id).replace('-', '')[:8]}"  # the flow run's own run name
    rollouts = tiny_setup.shared_dir / "runs" / name / "rounds" / "0000"
    assert sorted(p.name for p in rollouts.glob("shard-*.jsonl")) == [f"shard-{s:03d}.jsonl" for s in range(4)]

    # The run's artifacts: the rounds table and the reward curve (an inline SVG).
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [flow_run_id]}))
    by_type = sorted((a.type, a.key) for a in artifacts if a.key)  # one card per kind, keyed by the run name
    assert by_type == [("markdown", "flows-grpo-flaky-reward-curve"), ("markdown", "flows-grpo-flaky-training-job"),
                       ("markdown", "flows-grpo-flaky-training-metrics"), ("table", "flows-grpo-flaky-goodput"),
                       ("table", "flows-grpo-flaky-rounds")], by_type
    # The goodput: the round's sampling, publish and step job (queue, start-up, training) add up to the wall time.
    seconds = assert_goodput_adds_up(flow_run_id, next(a for a in artifacts if a.key == "flows-grpo-flaky-goodput"))
    assert min(seconds["sampling"], seconds["publish"], seconds["startup"], seconds["training"]) > 0, seconds
    table = next(a for a in artifacts if a.key == "flows-grpo-flaky-rounds")
    curve = next(a for a in artifacts if a.key == "flows-grpo-flaky-reward-curve")
    assert "](data:image/svg+xml;base64," in curve.data
    shown = json.loads(table.data)  # the result's rows, in the table's short form
    assert shown == round_table_rows(state.result().rounds), shown
    # Where the training curves are: the run folder's TensorBoard folder, one point for the one round.
    logdir = tiny_setup.shared_dir / "runs" / name / "tensorboard"
    assert state.result().tensorboard_dir == str(logdir)
    metrics = next(a for a in artifacts if a.key == "flows-grpo-flaky-training-metrics")
    assert f"`tensorboard --logdir {logdir}`" in metrics.data and f"tensorboard --logdir {logdir}" in table.description
    curves = scalar_curves(logdir)
    assert curves["train/loss"][0][0] == 0 and len(curves["train/loss"]) == len(curves["train/reward"]) == 1

    # Its events: the round finished (with the round's rewards and snapshot), the step job's end.
    events = wait_events(flow_run_id, lambda ev: named(ev, "posttrain.round.finished")
                         and named(ev, "posttrain.job.completed"))
    (finished,) = named(events, "posttrain.round.finished")
    row = state.result().rounds[0]
    assert finished.resource.id == f"posttrain.run.{name}" and finished.resource["posttrain.round"] == "0"
    assert finished.payload["samples"] == row["samples"] > 0
    assert round(finished.payload["reward_mean"], 4) == row["reward mean"]
    assert round(finished.payload["reward_std"], 4) == row["reward std"]
    assert finished.payload["snapshot"] == row["snapshot"]
    (job,) = named(events, "posttrain.job.completed")
    assert job.payload["run_name"] == name and job.payload["backend"] == "local"
    assert len(named(events, "posttrain.job.submitted")) == 1
