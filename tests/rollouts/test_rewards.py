"""Reward functions with TRL's signature."""

from __future__ import annotations

import pytest

from posttrain.rewards import completion_text, correctness_reward, format_reward, length_reward
from posttrain.rollouts.scoring import load_reward_funcs


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
