"""GRPO math for rollouts sampled elsewhere: token log-probs and the clipped loss.

Small pure functions over lists and tensors, so they can be tested without a model.
Conventions: tensors are [batch, positions]; ``mask`` is 1 on completion tokens, 0 elsewhere.
"""

from __future__ import annotations

from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]
LossType = Literal["dapo", "grpo", "dr_grpo"]


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position: logits [B, T, V], ids [B, T] -> [B, T-1]."""
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def truncated_importance_weights(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token min(pi_old / pi_behaviour, cap): corrects for rollouts sampled by a stale or
    numerically different policy without letting one token's weight explode (TIS)."""
    return torch.exp(old_logps - behaviour_logps).clamp(max=cap)


def per_token_policy_loss(
    new_logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    is_weights: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A) * w + beta * KL * r, per token.

    r = exp(new - old); ``advantages`` is per sequence [B]; ``is_weights`` are the (detached)
    truncated importance weights; the KL is the k3 estimator against ``ref_logps``, times r as in
    TRL's default ``use_bias_correction_kl`` (the unbiased reverse-KL gradient: r is 1 at the first
    pass, but its gradient is not, so this changes the gradient whenever beta > 0).
    """
    ratio = torch.exp(new_logps - old_logps)
    adv = advantages.unsqueeze(-1)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        delta = ref_logps - new_logps
        loss = loss + beta * (torch.exp(delta) - delta - 1) * ratio
    return loss


def aggregate_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: LossType = "dapo",
    *,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    ``total_tokens`` / ``total_sequences`` default to this batch's counts; pass the whole
    batch's counts when summing micro-batch losses, so the sum equals the full-batch loss.
    """
    mask = mask.to(token_loss.dtype)
    tokens = mask.sum().item() if total_tokens is None else total_tokens
    sequences = token_loss.shape[0] if total_sequences is None else total_sequences
    masked = token_loss * mask
    if loss_type == "dapo":
        return masked.sum() / max(tokens, 1.0)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(sequences, 1)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        return masked.sum() / (max(sequences, 1) * max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}")
