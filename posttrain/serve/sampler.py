"""Batched sampling with a KV cache: every choice of every prompt in one forward pass per token.

Reports, for each sampled token, its log-prob under the distribution it was drawn from: the
logits divided by the temperature, with top-p's cut applied and renormalised (vLLM's
``processed_logprobs``). With ``top_p`` = 1 this is log_softmax(logits / T), the quantity the
trainer recomputes. Greedy (T = 0, or below ``GREEDY_BELOW``) reports log_softmax(logits).
"""

from __future__ import annotations

import inspect
import secrets
from dataclasses import dataclass

import torch


# A temperature below this samples greedily, as vLLM does (its _SAMPLING_EPS): dividing the logits
# by a smaller one overflows to inf and the probabilities to NaN.
GREEDY_BELOW = 1e-5


@dataclass
class SampledChoice:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an end-of-sequence token, included) or "length"


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; the rest get -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    cut = before >= top_p
    cut[..., 0] = False  # the most likely token always stays: a top_p that rounds to 0 keeps just it
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _cache_arg(model: torch.nn.Module) -> str:
    # transformers 5 renamed past_key_values to cache
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out) -> object:
    cache = out.get("cache")
    return cache if cache is not None else out.get("past_key_values")


@torch.inference_mode()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    eos_token_ids: set[int],
    pad_token_id: int,
    seed: int | None = None,
    max_batch_rows: int = 64,
) -> list[SampledChoice]:
    """``n`` completions of each prompt, prompt-major (prompt 0's n choices, then prompt 1's ...)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    rows = [p for p in prompts for _ in range(n)]
    out: list[SampledChoice] = []
    for start in range(0, len(rows), max_batch_rows):
        out += _sample_rows(model, rows[start:start + max_batch_rows], device, max_tokens, temperature, top_p,
                            eos_token_ids, pad_token_id, generator)
    return out


def _sample_rows(model, rows, device, max_tokens, temperature, top_p, eos_ids, pad_id, generator):
    batch, width = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding: every row's next token is at the same column
        input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        attention[i, width - len(r):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache_arg = _cache_arg(model)
    res = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    next_pos = positions[:, -1:] + 1
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, logps, finished_at = [], [], torch.full((batch,), -1, dtype=torch.long, device=device)
    for step in range(max_tokens):
        logits = res.logits[:, -1, :].float()
        if temperature < GREEDY_BELOW:
            logp = logits.log_softmax(-1)
            token = logits.argmax(-1, keepdim=True)
        else:
            logp = top_p_filter(logits / temperature, top_p).log_softmax(-1)
            token = torch.multinomial(logp.exp(), 1, generator=generator)
        tokens.append(token[:, 0])
        logps.append(logp.gather(-1, token)[:, 0])
        hit = torch.isin(token[:, 0], eos) & ~done
        finished_at = torch.where(hit, torch.full_like(finished_at, step), finished_at)
        done |= hit
        if bool(done.all()) or step == max_tokens - 1:
            break
        feed = torch.where(done, torch.full_like(token[:, 0], pad_id), token[:, 0])[:, None]
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], dim=1)
        res = model(input_ids=feed, attention_mask=attention, position_ids=next_pos, use_cache=True,
                    **{cache_arg: _cache_of(res)})
        next_pos = next_pos + 1
    token_rows = torch.stack(tokens, dim=1).tolist()
    logp_rows = torch.stack(logps, dim=1).tolist()
    choices = []
    for i in range(batch):
        end = int(finished_at[i])
        if end >= 0:
            choices.append(SampledChoice(token_rows[i][: end + 1], logp_rows[i][: end + 1], "stop"))
        else:
            choices.append(SampledChoice(token_rows[i], logp_rows[i], "length"))
    return choices
