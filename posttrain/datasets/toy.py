"""A tiny built-in prompt dataset with reference answers, for tests and demos.

Rows are conversational prompts in the layout ``staging`` accepts and TRL trains on:
``{"prompt": [{"role": "user", "content": ...}], "answer": "...", "task": "..."}``.
Pure Python; the same seed gives the same rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

# Words of the "repeat" task; the tiny tokenizer's corpus holds them too.
TOY_WORDS = (
    "apple river stone cloud green seven orange tiger music window paper light "
    "garden silver planet yellow rabbit ocean forest winter summer bridge candle"
).split()

Task = Literal["arithmetic", "repeat", "mixed"]


def toy_prompt_rows(n: int = 16, seed: int = 0, task: Task = "mixed") -> list[dict]:
    """``n`` prompts: small additions ("What is 3 + 4?", answer "7") and/or "repeat the word"."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = task if task != "mixed" else ("arithmetic", "repeat")[i % 2]
        if kind == "arithmetic":
            a, b = rng.randrange(10), rng.randrange(10)
            question, answer = f"What is {a} + {b}? Answer with a number.", str(a + b)
        else:
            word = rng.choice(TOY_WORDS)
            question, answer = f"Repeat the word {word}.", word
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": answer, "task": kind})
    return rows


def write_toy_jsonl(path: str | Path, n: int = 16, seed: int = 0, task: Task = "mixed") -> Path:
    """Write ``toy_prompt_rows`` as JSONL (one row per line) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in toy_prompt_rows(n, seed, task):
            f.write(json.dumps(row) + "\n")
    return path
