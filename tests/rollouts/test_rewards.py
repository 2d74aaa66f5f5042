"""Reward functions with TRL's signature."""

from __future__ import annotations

import asyncio
import inspect
import sys

import pytest

from posttrain.rewards import completion_text, correctness_reward, format_reward, length_reward
from posttrain.rollouts.scoring import RewardError, finite_rewards, load_reward_funcs, reward_code_digest, score


def _chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_completion_text_accepts_strings_and_messages():
    assert completion_text("7") == "7" and completion_text(_chat("seven")) == "seven"


def test_correctness_uses_the_answer_column():
    completions = [_chat("7"), _chat("It is 7."), "apple", _chat("8"), ""]
    answers = ["7", "7", "Apple", "7", "7"]
    scores = correctness_reward(completions=completions, answer=answers, prompts=[None] * 5, trainer_state=None)
    assert scores == [1.0, 0.5, 1.0, 0.0, 0.0]


def test_format_and_length_rewards():
    completions = ["7", "a\nb", "", "x" * 40]
    assert format_reward(completions) == [1.0, 0.5, 0.0, 0.0]
    assert length_reward(["12345678", "", "1234"]) == [1.0, 0.0, 0.5]


@pytest.mark.parametrize(("paths", "message"), [
    (["posttrain.rewards:correctness_reward", "posttrain.rewards:nope"],
     "reward_funcs[1] 'posttrain.rewards:nope': 'posttrain.rewards' has no function 'nope'"),
    (["posttrain.nowhere:reward"], "reward_funcs[0] 'posttrain.nowhere:reward': cannot import 'posttrain.nowhere'"),
    (["posttrain.rewards"], "reward_funcs[0] 'posttrain.rewards': expected module:function"),
])
def test_a_reward_function_that_does_not_load_is_named(paths, message):
    with pytest.raises(ValueError) as raised:
        load_reward_funcs(paths)
    assert str(raised.value).startswith(message)


def _nan_reward(completions: list, **kwargs) -> list:
    return [0.5, float("nan")][: len(completions)]


def _inf_reward(completions: list, **kwargs) -> list:
    return [float("inf")] * len(completions)


def _none_reward(completions: list, **kwargs) -> list:
    return [None] * len(completions)


def _short_reward(completions: list, **kwargs) -> list:
    return [1.0]


def _score(funcs, names=None) -> list[float]:
    return score(funcs, None, [None, None], ["a", "b"], [[1], [2]], {}, names=names)


@pytest.mark.parametrize(("func", "message"), [
    (_nan_reward, "returned nan for completion 1: a reward must be a finite number"),
    (_inf_reward, "returned inf for completion 0: a reward must be a finite number"),
    (_short_reward, "returned 1 values for 2 completions"),
])
def test_a_reward_that_is_not_a_finite_number_is_an_error_naming_the_function(func, message):
    # a GRPO round's shards score with score(): a NaN (a reward service outage) used to count as 0
    with pytest.raises(RewardError) as raised:
        _score([format_reward, func], names=["posttrain.rewards:format_reward", "my.rewards:flaky"])
    assert str(raised.value) == f"reward function my.rewards:flaky {message}" + (
        " (a reward service outage?)" if "finite" in message else "")
    with pytest.raises(RewardError, match=rf"reward function {__name__}:{func.__name__} returned"):
        _score([func])  # without names: the function's own module:name


def test_none_is_no_reward_from_that_function_as_in_trl():
    assert _score([format_reward, _none_reward]) == [1.0, 1.0]


def test_a_non_finite_weight_is_refused():
    with pytest.raises(ValueError, match="reward_weights"):
        score([format_reward], [float("nan")], [None], ["a"], [[1]], {})


def test_the_trainers_reward_functions_refuse_nan_too():
    checked = finite_rewards(_nan_reward, "my.rewards:flaky")
    assert checked.__name__ == "_nan_reward"  # TRL names its reward metrics after it
    with pytest.raises(RewardError, match="reward function my.rewards:flaky returned nan for completion 1"):
        checked(completions=["a", "b"])
    assert finite_rewards(_none_reward, "x:y")(completions=["a"]) == [None]

    async def remote(completions: list, **kwargs) -> list:
        return [float("nan")] * len(completions)

    checked_async = finite_rewards(remote, "my.rewards:remote")
    assert inspect.iscoroutinefunction(checked_async)
    with pytest.raises(RewardError, match="my.rewards:remote returned nan"):
        asyncio.run(checked_async(completions=["a"]))


def test_the_code_digest_follows_the_reward_modules_source(tmp_path, monkeypatch):
    module = tmp_path / "digest_reward_mod.py"
    module.write_text("def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "digest_reward_mod", raising=False)
    paths = ["digest_reward_mod:reward"]
    before = reward_code_digest(paths)
    assert reward_code_digest(paths) == before
    module.write_text("def reward(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    assert reward_code_digest(paths) == before  # this process still runs the code it imported
    del sys.modules["digest_reward_mod"]  # a new process imports the new code
    assert reward_code_digest(paths) != before
    assert reward_code_digest(["posttrain.rewards:format_reward"]) != reward_code_digest(
        ["posttrain.rewards:length_reward"])
