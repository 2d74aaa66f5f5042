"""A shard's rollouts carry the snapshot identity that sampled them, checked against the one the
round hot-loaded: against the real reference server (in a thread), a reply from any other version
fails the shard, naming the shard, the expected and the served identity, and writes nothing."""

from __future__ import annotations

import pytest

from posttrain.pipeline.tasks.retry import is_transient
from posttrain.rollouts.client import CompletionsClient, CompletionsConfig
from posttrain.rollouts.format import load_rollouts
from posttrain.rollouts.scoring import RewardError
from posttrain.rollouts.shard import RolloutSettings, ShardSpec, SnapshotMismatch, run_shard
from tests.support.serving import TOKEN

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(3)]

# What the reward function below does on its first call (set by a test, reset after it).
_ON_FIRST_REWARD: list = []


def hot_load_on_first_reward(completions: list, **kwargs) -> list[float]:
    """A reward of 0 that, the first time it is called, runs the action a test left for it: here,
    hot-loading another version into the deployment while the shard is sampling."""
    while _ON_FIRST_REWARD:
        _ON_FIRST_REWARD.pop()()
    return [0.0] * len(completions)


def nan_reward(completions: list, **kwargs) -> list[float]:
    """What a reward service that is down answers through a client that maps failures to NaN."""
    return [float("nan")] * len(completions)


def _settings(reward: str = "posttrain.rewards:correctness_reward") -> RolloutSettings:
    return RolloutSettings(num_generations=2, max_completion_length=4, reward_funcs=[reward])


def _spec(tmp_path, identity: str | None, rows=ROWS, policy_version: int = 3) -> ShardSpec:
    return ShardSpec(round=1, shard=2, rows=rows, policy_version=policy_version, identity=identity,
                     out_path=tmp_path / "shard-002.jsonl")


@pytest.fixture
def served(chain, server, make_client):
    """The reference server hot-loaded with the chain's full snapshot, and a completions client."""
    make_client(server).hot_load(chain.full)
    client = CompletionsClient(CompletionsConfig(gateway_url=server.url, model="tiny", token=TOKEN, max_attempts=1))
    yield server, client
    client.close()


@pytest.fixture
def tokenizer(chain):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chain.models[0])


def test_the_client_returns_the_identity_that_sampled_the_reply(chain, served):
    _, client = served
    reply = client.complete([5, 6, 7], n=2, max_tokens=3, temperature=1.0, top_p=1.0)
    assert reply.snapshot_identity == chain.full
    assert len(reply) == 2 and [c.token_ids for c in reply] == [reply[0].token_ids, reply[1].token_ids]
    first, _ = reply  # unpacks as its choices, as before
    assert first is reply.choices[0]


def test_every_rollout_records_the_policy_version_and_the_identity_checked(chain, served, tokenizer, tmp_path):
    _, client = served
    result = run_shard(_spec(tmp_path, chain.full), _settings(), client, tokenizer)
    rollouts, _ = load_rollouts(result.path)
    assert result.samples == len(rollouts) > 0
    assert {(r.policy_version, r.snapshot_identity) for r in rollouts} == {(3, chain.full)}
    assert result.snapshot_identity == chain.full


def test_a_shard_expecting_a_version_the_deployment_does_not_serve_fails_naming_both(chain, served, tokenizer,
                                                                                    tmp_path):
    _, client = served
    spec = _spec(tmp_path, chain.d1)
    with pytest.raises(SnapshotMismatch) as info:
        run_shard(spec, _settings(), client, tokenizer)
    message = str(info.value)
    assert "shard 2 of round 1" in message and chain.d1 in message and chain.full in message
    assert (info.value.expected, info.value.served) == (chain.d1, chain.full)
    assert not is_transient(info.value)  # the shard task does not retry it
    assert not spec.out_path.exists()


def test_a_version_hot_loaded_mid_shard_fails_the_shard(chain, served, make_client, tokenizer, tmp_path):
    server, client = served
    loader = make_client(server)
    _ON_FIRST_REWARD.append(lambda: loader.hot_load(chain.d1, base_identity=chain.full))
    spec = _spec(tmp_path, chain.full)
    try:
        with pytest.raises(SnapshotMismatch) as info:
            run_shard(spec, _settings("tests.rollouts.test_shard_identity:hot_load_on_first_reward"), client,
                      tokenizer)
    finally:
        _ON_FIRST_REWARD.clear()
    assert (info.value.shard, info.value.expected, info.value.served) == (2, chain.full, chain.d1)
    assert "hot-loaded into the deployment mid-round" in str(info.value)
    assert not spec.out_path.exists()  # no rollout of the shard is kept, not even the first prompt's


def test_a_nan_reward_fails_the_shard_naming_the_function_and_keeps_nothing(chain, served, tokenizer, tmp_path):
    _, client = served
    spec = _spec(tmp_path, chain.full)
    with pytest.raises(RewardError) as info:  # it used to be summed as 0 and trained on
        run_shard(spec, _settings("tests.rollouts.test_shard_identity:nan_reward"), client, tokenizer)
    assert str(info.value).startswith("reward function tests.rollouts.test_shard_identity:nan_reward returned nan")
    assert not spec.out_path.exists()


def test_without_an_expected_identity_the_reply_s_is_recorded(chain, served, tokenizer, tmp_path):
    _, client = served
    result = run_shard(_spec(tmp_path, None, rows=ROWS[:1]), _settings(), client, tokenizer)
    rollouts, _ = load_rollouts(result.path)
    assert {r.snapshot_identity for r in rollouts} == {chain.full} and result.snapshot_identity == chain.full


def test_rollout_files_written_before_the_identity_was_recorded_still_load(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text('{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-0.5], "reward": 1.0, '
                    '"group_id": "g", "policy_version": 0}\n')
    (rollout,), _ = load_rollouts(path)
    assert rollout.snapshot_identity is None
