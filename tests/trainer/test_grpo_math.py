"""Advantages, importance weights and the clipped loss of the rollout-trained GRPO step."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.rollouts.scoring import group_advantages
from posttrain.trainer.grpo_math import (
    aggregate_loss,
    per_token_policy_loss,
    token_logps,
    truncated_importance_weights,
)


def test_group_advantages_normalize_within_each_group():
    rewards = [1.0, 0.0, 1.0, 0.0, 5.0, 5.0, 7.0]
    groups = ["a", "a", "b", "b", "c", "c", "solo"]
    adv = group_advantages(rewards, groups)
    std_ab = math.sqrt(0.5)  # sample std of {1, 0}
    assert adv[:4] == pytest.approx([0.5 / (std_ab + 1e-4), -0.5 / (std_ab + 1e-4)] * 2)
    assert adv[4:6] == [0.0, 0.0]  # equal rewards: no signal
    assert adv[6] == 0.0  # a group of one has no baseline but itself


def test_group_advantages_scaling_modes():
    rewards, groups = [1.0, 3.0, 10.0, 20.0], [0, 0, 1, 1]
    assert group_advantages(rewards, groups, scale="none") == [-1.0, 1.0, -5.0, 5.0]
    batch_std = torch.tensor(rewards).std().item()
    assert group_advantages(rewards, groups, scale="batch") == pytest.approx(
        [a / (batch_std + 1e-4) for a in (-1.0, 1.0, -5.0, 5.0)]
    )
    with pytest.raises(ValueError):
        group_advantages([1.0], [0, 1])


def test_token_logps_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    expected = (logits[:, :-1] / 0.7).log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(token_logps(logits, ids, temperature=0.7), expected, atol=1e-6)


def test_truncated_importance_weights_cap():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -0.5]])
    w = truncated_importance_weights(old, behaviour, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, math.exp(-0.5)])  # e^1 = 2.72 capped at 2


def test_on_policy_loss_is_minus_advantage_with_its_gradient():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 2)
    token_loss = per_token_policy_loss(logps, logps.detach(), adv)
    loss = aggregate_loss(token_loss, mask, "dapo")
    assert loss.item() == pytest.approx((-1 - 1 + 2 + 2) / 4)
    loss.backward()
    # d/dlogp of -ratio*A at ratio 1 is -A, averaged over 4 tokens
    assert torch.allclose(logps.grad, torch.tensor([[-0.25, -0.25], [0.5, 0.5]]))


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.9]])).requires_grad_()  # ratios 1.5 (clipped) and 0.9
    token_loss = per_token_policy_loss(new, old, torch.tensor([1.0]), epsilon_low=0.2, epsilon_high=0.28)
    assert token_loss.tolist()[0] == pytest.approx([-1.28, -0.9])
    token_loss.sum().backward()
    assert new.grad.tolist()[0] == pytest.approx([0.0, -0.9])
    # A negative advantage is clipped at 1 - eps from below.
    low = per_token_policy_loss(torch.log(torch.tensor([[0.5]])), torch.zeros(1, 1), torch.tensor([-1.0]))
    assert low.item() == pytest.approx(0.8)


def test_importance_weights_scale_the_loss_and_are_not_differentiated():
    new = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[2.0, 0.5]], requires_grad=True)
    token_loss = per_token_policy_loss(new, new.detach(), torch.tensor([1.0]), is_weights=w)
    assert token_loss.tolist()[0] == pytest.approx([-2.0, -0.5])
    token_loss.sum().backward()
    assert w.grad is None


def test_kl_term_is_zero_at_the_reference_and_positive_elsewhere():
    new = torch.tensor([[-1.0, -2.0]])
    zero_adv = torch.tensor([0.0])
    at_ref = per_token_policy_loss(new, new, zero_adv, ref_logps=new, beta=0.1)
    assert at_ref.abs().max().item() == 0.0
    away = per_token_policy_loss(new, new, zero_adv, ref_logps=new - 0.5, beta=0.1)
    assert away.tolist()[0] == pytest.approx([0.1 * (math.exp(-0.5) + 0.5 - 1)] * 2)
    with pytest.raises(ValueError):
        per_token_policy_loss(new, new, zero_adv, beta=0.1)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batch_losses_sum_to_the_full_batch_loss(loss_type):
    torch.manual_seed(1)
    token_loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    kw = dict(max_completion_length=5)
    full = aggregate_loss(token_loss, mask, loss_type, **kw)
    parts = sum(
        aggregate_loss(
            token_loss[i : i + 4],
            mask[i : i + 4],
            loss_type,
            total_tokens=float(mask.sum()),
            total_sequences=6,
            **kw,
        )
        for i in (0, 4)
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-5)


def test_loss_types_differ_as_documented():
    token_loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate_loss(token_loss, mask, "dapo").item() == pytest.approx(8 / 5)
    assert aggregate_loss(token_loss, mask, "grpo").item() == pytest.approx((1 + 4) / 2)
    assert aggregate_loss(token_loss, mask, "dr_grpo", max_completion_length=8).item() == pytest.approx(8 / 16)
    with pytest.raises(ValueError):
        aggregate_loss(token_loss, mask, "dr_grpo")
