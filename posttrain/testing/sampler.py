"""A local stand-in for the inference deployment: sample rollouts with behaviour log-probs.

Test-only: for tests and offline demos of ``mode: step``. It samples from the full distribution
(``top_k=0``) and reports log-probs of the raw logits after temperature, the quantity the
trainer recomputes; a server must report the same (vLLM: ``--logprobs-mode processed_logprobs``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from posttrain.rollouts.format import Rollout


def sample_rollouts(
    model_dir: str | os.PathLike[str],
    rows: list[dict],
    *,
    group_size: int = 4,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    policy_version: int = 0,
    seed: int = 0,
    reward_func: Callable[..., list[float]] | None = None,
) -> list[Rollout]:
    """``group_size`` completions per prompt row (a dataset row with ``prompt`` messages).

    ``reward_func`` has TRL's signature and receives the row's extra columns; without one,
    every reward is 0.0. Group ids are the row indices.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = tokenizer.eos_token_id
    rollouts = []
    for group, row in enumerate(rows):
        prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        ids = torch.tensor([list(prompt_ids)])
        torch.manual_seed(seed * 100_003 + group)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                num_return_sequences=group_size,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos,
            )
        completions = out.sequences[:, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float() / temperature
        logps = logits.log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        samples = []
        for comp, lp in zip(completions.tolist(), logps.tolist(), strict=True):
            end = comp.index(eos) + 1 if eos in comp else len(comp)
            samples.append((comp[:end], lp[:end]))
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c, _ in samples]
        extra = {k: [v] * group_size for k, v in row.items() if k != "prompt"}
        rewards = reward_func(completions=texts, **extra) if reward_func else [0.0] * group_size
        for (comp, lp), reward in zip(samples, rewards, strict=True):
            rollouts.append(
                Rollout(
                    prompt_ids=list(prompt_ids),
                    completion_ids=comp,
                    logprobs=lp,
                    reward=float(reward),
                    group_id=group,
                    policy_version=policy_version,
                )
            )
    return rollouts
