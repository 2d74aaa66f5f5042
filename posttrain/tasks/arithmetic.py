"""The "arithmetic" task: one- and two-digit sums, differences and one-digit products.

Prompt: "What is 23 + 58? Reply with only the number." The answer format is a bare integer ("81";
surrounding whitespace and one trailing period are allowed). Differences are never negative (the
first operand is the larger), so every answer is a whole number from 0 to 198.

Strata, taken in turn: + and - with two one-digit operands, with one of each, with two two-digit
operands; x (written "×") with two one-digit operands. Operands of one digit are 0-9, of two 10-99.

Rewards (TRL's signature; ``answer`` is the reference column):

- ``arithmetic_correct``: 1.0 when the reply is only the right number, 0.5 when it says more but its
  last number is the right one ("23 + 58 = 81"), else 0.0. Only the last number counts, so a reply
  that lists many numbers earns nothing for the right one among them.
- ``arithmetic_format``: 1.0 for a bare integer; 0.5 for one short line (at most FORMAT_MAX_CHARS
  characters) holding a number; 0.25 for a longer reply holding a number; 0.0 for no number at all.

``accuracy`` is the held-out measure: the share of replies whose last number is the answer (only
replies that are the bare number with ``strict``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from posttrain.tasks.base import Task, completion_texts, whole_number

NAME = "arithmetic"
INSTRUCTION = "Reply with only the number."
TIMES = "×"
FORMAT_MAX_CHARS = 32
ONE_DIGIT = range(10)
TWO_DIGITS = range(10, 100)

# A number: digits with an optional decimal part; a "-" directly before it is a sign unless it follows
# a letter or digit ("23-5" is 23 and 5, "= -5" is -5).
_NUMBER = re.compile(r"(?:(?<![\w.-])-)?(?<![\d.])\d+(?:\.\d+)?")
_BARE_INTEGER = re.compile(r"-?\d+\.?")


def _strata() -> list[list[str]]:
    def sums(a_range: range, b_range: range, both_orders: bool = False) -> list[str]:
        keys = [f"{a} + {b}" for a in a_range for b in b_range]
        return keys + ([f"{b} + {a}" for a in a_range for b in b_range] if both_orders else [])

    def differences(a_range: range, b_range: range) -> list[str]:
        return [f"{a} - {b}" for a in a_range for b in b_range if a >= b]

    return [
        sums(ONE_DIGIT, ONE_DIGIT), sums(TWO_DIGITS, ONE_DIGIT, both_orders=True), sums(TWO_DIGITS, TWO_DIGITS),
        differences(ONE_DIGIT, ONE_DIGIT), differences(TWO_DIGITS, ONE_DIGIT), differences(TWO_DIGITS, TWO_DIGITS),
        [f"{a} {TIMES} {b}" for a in ONE_DIGIT for b in ONE_DIGIT],
    ]


def solve(problem: str) -> int:
    """The answer to a problem key such as "23 + 58", "9 - 4" or "7 × 8"."""
    a, op, b = problem.split(" ")
    x, y = int(a), int(b)
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == TIMES:
        return x * y
    raise ValueError(f"{problem!r}: unknown operation {op!r}")


def _row(problem: str) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": f"What is {problem}? {INSTRUCTION}"}],
        "answer": str(solve(problem)),
        "problem": problem,
    }


TASK = Task(
    name=NAME,
    description="One- and two-digit +, - and one-digit × problems; the reply is only the number.",
    reward_funcs=("posttrain.tasks.arithmetic:arithmetic_correct", "posttrain.tasks.arithmetic:arithmetic_format"),
    reward_weights=(1.0, 0.5),
    strata=_strata,
    make_row=_row,
)


def numbers(text: str) -> list[Decimal]:
    """The numbers in ``text``, in order ("3 + 4 = 7" -> 3, 4, 7)."""
    return [Decimal(m) for m in _NUMBER.findall(text)]


def bare_integer(text: str) -> int | None:
    """The integer when ``text`` is only one (whitespace and one trailing period allowed), else None."""
    text = text.strip()
    return int(text.rstrip(".")) if _BARE_INTEGER.fullmatch(text) else None


def extract_answer(text: str) -> Decimal | None:
    """The number a reply answers with: its last number; None when it has none."""
    found = numbers(text)
    return found[-1] if found else None


def arithmetic_correct(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 for only the right number, 0.5 when the reply's last number is right but it says more, else 0.0."""
    texts = completion_texts("arithmetic_correct", completions, answer=answer)
    scores = []
    for i, (text, ref) in enumerate(zip(texts, answer, strict=True)):
        expected = whole_number("arithmetic_correct", "answer", i, ref)
        bare = bare_integer(text)
        if bare is not None:
            scores.append(1.0 if bare == expected else 0.0)
        else:
            scores.append(0.5 if extract_answer(text) == expected else 0.0)
    return scores


def arithmetic_format(completions: list, **kwargs) -> list[float]:
    """1.0 for a bare integer, 0.5 for one short line with a number, 0.25 for a longer one, 0.0 for none."""
    scores = []
    for text in completion_texts("arithmetic_format", completions):
        text = text.strip()
        if bare_integer(text) is not None:
            scores.append(1.0)
        elif not numbers(text):
            scores.append(0.0)
        elif len(text) <= FORMAT_MAX_CHARS and "\n" not in text:
            scores.append(0.5)
        else:
            scores.append(0.25)
    return scores


def accuracy(completions: Sequence, answer: Sequence, strict: bool = False) -> float:
    """The share of completions whose answer number (the last number of the reply; with ``strict``,
    only a reply that is the bare number) is exactly the reference. A ValueError for no completions."""
    texts = completion_texts("accuracy", completions, answer=answer)
    if not texts:
        raise ValueError("accuracy: no completions to score")
    hits = 0
    for i, (text, ref) in enumerate(zip(texts, answer, strict=True)):
        expected = whole_number("accuracy", "answer", i, ref)
        got = bare_integer(text) if strict else extract_answer(text)
        hits += got is not None and got == expected
    return hits / len(texts)


def answer_correct(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the reply's answer (its last number) is exactly the reference, else 0.0: per completion,
    what ``accuracy`` averages. The held-out eval's reward (the demo's gate judges on it)."""
    texts = completion_texts("answer_correct", completions, answer=answer)
    return [1.0 if extract_answer(text) == whole_number("answer_correct", "answer", i, ref) else 0.0
            for i, (text, ref) in enumerate(zip(texts, answer, strict=True))]
