"""Fixtures of the eval gate's tests: an eval set whose references are m2's greedy answers (so m2
scores 1.0, m1 and m0 far less under ``posttrain.testing.rewards:reference_match``), and
promotion settings that evaluate greedily."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.serving import Chain, local_greedy

REWARD = "posttrain.testing.rewards:reference_match"
EVAL_PROMPTS = 10
MAX_TOKENS = 6
QUESTIONS = ["What is {a} plus {b}?", "Name the color of item {a}.", "Count to {b}.", "Say hello to {a} and {b}."]


def eval_rows(chain: Chain, *, reference: int = 2, prompts: int = EVAL_PROMPTS) -> list[dict]:
    """Eval prompts whose ``reference_ids`` are model ``reference``'s greedy continuation."""
    from transformers import AutoTokenizer

    from posttrain.rollouts.shard import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(chain.models[0])
    rows = []
    for i in range(prompts):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(a=i + 2, b=2 * i + 3)}]
        ids = chat_prompt_ids(tokenizer, messages)
        rows.append({"prompt": messages, "id": f"q{i:02d}",
                     "reference_ids": local_greedy(chain.models[reference], ids, max_tokens=MAX_TOKENS)})
    return rows


def write_eval_set(chain: Chain, path: Path, **kw) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in eval_rows(chain, **kw)))
    return path


def greedy_eval(**overrides) -> dict:
    """EvalSettings values: greedy (a temperature under 1e-5 samples greedily, here and in vLLM)."""
    return {"samples_per_prompt": 2, "max_tokens": MAX_TOKENS, "temperature": 1e-6, "reward_funcs": [REWARD],
            **overrides}
