"""The "length" task: an instruction with a verifiable constraint, an exact number of words.

Prompt: "Describe the ocean in exactly 5 words. Reply with only the description." The whole reply is
counted: a word is a run of letters or digits, an apostrophe or hyphen inside one keeps it one word
("don't", "well-known"), punctuation is not a word. Targets are 3 to 10 words; one stratum per target.

Rows carry ``target_words`` (an int; ``answer`` is the same number as text). Rewards (TRL's signature):

- ``length_constraint``: graded by distance, max(0, 1 - |words - target| / target): 1.0 on target,
  0.0 for no words or twice the target or more.
- ``constraint_met``: 1.0 when the reply has exactly the target number of words, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.tasks.base import Task, completion_texts, whole_number

NAME = "length"
TARGETS = range(3, 11)
TOPICS = (
    "the ocean", "a cat", "a dog", "winter", "summer", "the moon", "the sun", "a forest", "a city", "rain",
    "a river", "a mountain", "coffee", "a library", "the wind", "a garden", "a train", "snow", "a bicycle",
    "the desert", "a candle", "music", "a bridge", "an apple", "a storm", "the night sky", "a kitchen",
    "a school", "a clock", "bread", "a beach", "a rainbow", "a volcano", "a market", "a lighthouse",
    "a piano", "autumn", "spring", "a friend", "the sea breeze",
)

_WORD = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")


def word_count(text: str) -> int:
    """The number of words in ``text`` as the task counts them."""
    return len(_WORD.findall(text))


def _strata() -> list[list[str]]:
    return [[f"{topic} | {n}" for topic in TOPICS] for n in TARGETS]


def _row(problem: str) -> dict[str, Any]:
    topic, _, n = problem.partition(" | ")
    return {
        "prompt": [{"role": "user", "content": f"Describe {topic} in exactly {n} words. "
                                               "Reply with only the description."}],
        "answer": n,
        "problem": problem,
        "target_words": int(n),
    }


TASK = Task(
    name=NAME,
    description="Describe a topic in exactly N words (3-10); rewarded by the distance to N and by hitting it.",
    reward_funcs=("posttrain.tasks.instruct:length_constraint", "posttrain.tasks.instruct:constraint_met"),
    reward_weights=(1.0, 1.0),
    strata=_strata,
    make_row=_row,
)


def _targets(func: str, target_words: list) -> list[int]:
    targets = [whole_number(func, "target_words", i, t) for i, t in enumerate(target_words)]
    for i, t in enumerate(targets):
        if t < 1:
            raise ValueError(f"{func}: target_words[{i}] is {t}, not a positive number of words")
    return targets


def length_constraint(completions: list, target_words: list, **kwargs) -> list[float]:
    """max(0, 1 - |words - target| / target) for each completion: 1.0 on target, down to 0.0."""
    texts = completion_texts("length_constraint", completions, target_words=target_words)
    targets = _targets("length_constraint", target_words)
    return [max(0.0, 1.0 - abs(word_count(text) - t) / t) for text, t in zip(texts, targets, strict=True)]


def constraint_met(completions: list, target_words: list, **kwargs) -> list[float]:
    """1.0 when the completion has exactly ``target_words`` words, else 0.0."""
    texts = completion_texts("constraint_met", completions, target_words=target_words)
    targets = _targets("constraint_met", target_words)
    return [1.0 if word_count(text) == t else 0.0 for text, t in zip(texts, targets, strict=True)]
