"""The rollout-trained GRPO update (``mode: step`` / ``resident``) computes what TRL's GRPOTrainer computes.

The same rollouts (two prompts of different lengths, three completions each of different lengths, a reward
per completion, the sampler's log-probs) go to both sides:

- the project: ``PolicyTrainer.update`` on ``select_update``'s selection, so ``group_advantages``,
  ``collate`` (two micro-batches, 4 + 2 rollouts) and ``grpo_update.train`` with the ``grpo_math`` functions;
- TRL: a ``GRPOTrainer`` on the same model folder whose ``rollout_func`` returns these completions and
  whose reward function returns these rewards; ``_generate_and_score_completions`` computes the
  advantages, the old, reference and sampler log-probs and the importance-sampling ratio, and
  ``compute_loss`` (``_compute_loss``) the loss, once per iteration on the same inputs, as TRL's buffered
  generation batch is reused for ``num_iterations`` optimizer steps.

The sampler's log-probs are the policy's own plus noise, so the truncated importance weights
min(pi_old / pi_behaviour, cap) are far from 1 and some are capped. TRL applies the same correction only
with vLLM (``vllm_importance_sampling_correction``, mode ``token_truncate``, ``clip_max`` = the cap): its
switch ``use_vllm`` is turned on after construction (no vLLM is started; the rollout function stands in for
it). ``test_on_policy_rollouts_match_the_plain_trainer`` also checks TRL's plain path (no vLLM, old
log-probs computed by TRL itself or taken as the detached new ones) with the sampler's log-probs equal to
the policy's, where the project's weights are 1.

Both sides take the same SGD step after each pass (gradient clipping set out of reach, so that the
gradients compared are the objective's), and each pass's loss and every parameter's gradient are compared,
the second pass of ``num_iterations: 2`` included, where the ratio pi / pi_old is no longer 1 and clips.
``test_the_comparison_detects_a_different_update`` makes sure the comparison fails when one setting differs.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from posttrain.rollouts.format import Rollout
from posttrain.trainer import grpo_update
from posttrain.trainer.config import TrainerConfig
from posttrain.trainer.grpo_math import token_logps
from posttrain.trainer.policy import PolicyTrainer, select_update

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

RTOL = 1e-5
PROMPT_LENGTHS = (4, 7)  # TRL left-pads the shorter prompt, the project right-pads whole sequences
COMPLETION_LENGTHS = ((3, 5, 2), (6, 1, 4))  # right-padded on both sides
REWARDS = ((1.0, 0.0, 0.25), (3.0, -1.0, 0.5))
GROUP_SIZE = 3
MAX_COMPLETION_LENGTH = 8  # above the longest completion: dr_grpo divides by it, not by the longest
TEMPERATURE = 0.7
EPSILON, EPSILON_HIGH = 0.2, 0.28
IS_CAP = 1.5
BEHAVIOUR_NOISE = 0.4  # std of the sampler's log-prob error, nats
# Both sides take this SGD step between passes. Not AdamW (PolicyTrainer's): its first step, about lr * sign(g),
# turns the rounding noise of gradients near 0 into whole steps, which the second pass would compare.
LEARNING_RATE = 2e-2  # some of the second pass's ratios leave the clip range
LOSS_FLOOR = 1e-2  # a loss can be ~0 by construction (on policy, grpo: a group's advantages sum to 0): its
# rounding error is relative to the terms summed (order 1), not to their sum
NO_CLIPPING = 1e6  # max_grad_norm: clipping would hide a gradient's scale


def _checkpointing_field() -> str:
    """transformers 5 renamed gradient_checkpointing (TRL turns it on by default), as trainer/grpo.py does."""
    import dataclasses

    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


CHECKPOINTING = _checkpointing_field()


@pytest.fixture(scope="module")
def policy_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The policy trained: the tiny model (the reference) with every weight moved, so that the KL term is not 0."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("policy")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rollouts(policy_dir) -> list[Rollout]:
    """Six rollouts in two groups, with behaviour log-probs = the policy's (at TEMPERATURE) + noise."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    out = []
    for g, (p_len, c_lens, rewards) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS, REWARDS, strict=True)):
        prompt = torch.randint(3, vocab, (p_len,), generator=gen).tolist()  # 0-2 are the special tokens
        for c_len, reward in zip(c_lens, rewards, strict=True):
            completion = torch.randint(3, vocab, (c_len,), generator=gen).tolist()
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                own = token_logps(model(input_ids=ids).logits, ids, TEMPERATURE)[0, p_len - 1 :]
            noise = BEHAVIOUR_NOISE * torch.randn(c_len, generator=gen)
            logprobs = (own + noise).clamp(max=0).tolist()
            out.append(Rollout(prompt_ids=prompt, completion_ids=completion, logprobs=logprobs, reward=reward,
                               group_id=f"g{g}", policy_version=0))
    return out


def project_update(model_dir: Path, ref_dir: Path, rollouts: list[Rollout], tmp: Path, monkeypatch, **settings):
    """The project's update: its advantages, and each pass's loss and gradients (name -> tensor)."""
    config = TrainerConfig(**{
        "mode": "step", "model_name_or_path": str(model_dir), "output_dir": tmp / "out",
        "rollouts": tmp / "rollouts.jsonl", "ref_model_name_or_path": str(ref_dir),
        "per_device_train_batch_size": 4, "learning_rate": LEARNING_RATE, "max_grad_norm": NO_CLIPPING,
        "temperature": TEMPERATURE, "epsilon": EPSILON, "epsilon_high": EPSILON_HIGH, "importance_sampling_cap": IS_CAP,
        "max_completion_length": MAX_COMPLETION_LENGTH, "use_cpu": True, "report_to": ["none"], **settings,
    })
    losses: list[list[torch.Tensor]] = [[]]  # per pass, per micro-batch
    real_aggregate = grpo_update.aggregate_loss

    def recording_aggregate(*args, **kwargs):
        loss = real_aggregate(*args, **kwargs)
        losses[-1].append(loss.detach())
        return loss

    monkeypatch.setattr(grpo_update, "aggregate_loss", recording_aggregate)
    trainer = PolicyTrainer(config, threading.Event())
    trainer.load(model_dir)
    trainer.optimizer = torch.optim.SGD(trainer.optimizer.param_groups[0]["params"], lr=LEARNING_RATE)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    grads: list[dict[str, torch.Tensor]] = []
    real_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):  # after the pass's backward over every micro-batch
        grads.append({names[id(p)]: p.grad.clone() for g in trainer.optimizer.param_groups for p in g["params"]})
        losses.append([])
        return real_step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    selection = select_update(rollouts, "sha", tmp / "rollouts.jsonl", 0, config)
    metrics = trainer.update(selection)
    monkeypatch.undo()
    return {
        "advantages": torch.tensor(selection.advantages),
        "losses": [float(sum(parts)) for parts in losses[:-1]],
        "grads": grads,
        "metrics": metrics,
    }


def column_reward(completions, reward, **kwargs):
    """The rollout's reward, from the dataset column of that name."""
    return list(reward)


def trl_update(model_dir: Path, ref_dir: Path, rollouts: list[Rollout], tmp: Path, *, importance_sampling: bool = True,
               loss_type="dapo", beta=0.0, num_iterations=1, scale_rewards="group", **settings):
    """TRL's update of the same rollouts: its advantages, and each pass's loss and gradients."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    def rollout_func(prompts, trainer):
        assert len(prompts) == len(rollouts)
        return {"prompt_ids": [r.prompt_ids for r in rollouts], "completion_ids": [r.completion_ids for r in rollouts],
                "logprobs": [r.logprobs for r in rollouts]}

    rows = [{"prompt": f"prompt {r.group_id}", "reward": r.reward} for r in rollouts]
    args = GRPOConfig(
        output_dir=str(tmp / "trl"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        per_device_train_batch_size=len(rollouts), gradient_accumulation_steps=1, num_generations=GROUP_SIZE,
        max_completion_length=MAX_COMPLETION_LENGTH,
        learning_rate=LEARNING_RATE, weight_decay=0.0, max_grad_norm=NO_CLIPPING, temperature=TEMPERATURE,
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, loss_type=loss_type, beta=beta, num_iterations=num_iterations,
        scale_rewards=scale_rewards, vllm_importance_sampling_correction=importance_sampling,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=IS_CAP,
        **{CHECKPOINTING: False}, **settings,
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # TRL loads the reference (and the tokenizer) from the folder the policy instance names
    policy.config._name_or_path = str(ref_dir)
    trainer = GRPOTrainer(model=policy, reward_funcs=column_reward, args=args, train_dataset=Dataset.from_list(rows),
                          rollout_func=rollout_func)
    assert (trainer.ref_model is not None) == (beta > 0)
    if importance_sampling:
        trainer.use_vllm = True  # the rollouts' log-probs play the vLLM sampler's
        trainer._last_loaded_step = trainer.state.global_step  # no vLLM weights to sync
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets
    model = trainer.model
    model.train()
    inputs = trainer._generate_and_score_completions(rows)
    assert ("importance_sampling_ratio" in inputs) == importance_sampling
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LEARNING_RATE)
    losses, grads = [], []
    for _ in range(num_iterations):  # TRL reuses the generation batch for num_iterations steps
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
    return {"advantages": inputs["advantages"].float(), "losses": losses, "grads": grads, "inputs": inputs}


def differences(mine: dict, trl: dict) -> dict[str, float]:
    """Relative differences (of norms for tensors): the advantages, each pass's loss (LOSS_FLOOR), and each
    pass's gradient of the parameter that differs most."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp(min=1e-12))

    out = {"advantages": rel(mine["advantages"], trl["advantages"])}
    assert len(mine["losses"]) == len(trl["losses"]) == len(mine["grads"]) == len(trl["grads"])
    for i, (a, b) in enumerate(zip(mine["losses"], trl["losses"], strict=True)):
        out[f"loss[{i}]"] = abs(a - b) / max(abs(b), LOSS_FLOOR)
    for i, (ga, gb) in enumerate(zip(mine["grads"], trl["grads"], strict=True)):
        assert ga.keys() == gb.keys()
        out[f"grads[{i}]"] = max(rel(ga[n], gb[n]) for n in gb)
    return out


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_update_matches_trl(policy_dir, tiny_model_dir, rollouts, tmp_path, monkeypatch, loss_type, beta,
                            num_iterations, scale_rewards):
    settings = dict(loss_type=loss_type, beta=beta, num_iterations=num_iterations, scale_rewards=scale_rewards)
    mine = project_update(policy_dir, tiny_model_dir, rollouts, tmp_path, monkeypatch, **settings)
    trl = trl_update(policy_dir, tiny_model_dir, rollouts, tmp_path, **settings)
    diff = differences(mine, trl)
    assert max(diff.values()) <= RTOL, diff
    # The batch exercises what it is meant to: weights far from 1 and capped, clipping on the second pass.
    metrics = mine["metrics"]
    assert metrics["is_capped_fraction"] > 0 and abs(metrics["mean_logp_old_minus_behaviour"]) > 0.05
    if num_iterations == 2:
        assert metrics["clip_fraction"] > 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_on_policy_rollouts_match_the_plain_trainer(policy_dir, tiny_model_dir, rollouts, tmp_path, monkeypatch,
                                                    loss_type):
    """Without TRL's vLLM correction, for rollouts sampled by the policy itself (the project's weights are 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    on_policy = []
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            own = token_logps(model(input_ids=ids).logits, ids, TEMPERATURE)[0, len(r.prompt_ids) - 1 :]
        on_policy.append(r.model_copy(update={"logprobs": own.tolist()}))
    for num_iterations in (1, 2):  # TRL: old log-probs as the detached new ones, then computed at generation
        settings = dict(loss_type=loss_type, beta=0.04, num_iterations=num_iterations, scale_rewards="group")
        mine = project_update(policy_dir, tiny_model_dir, on_policy, tmp_path, monkeypatch, **settings)
        trl = trl_update(policy_dir, tiny_model_dir, on_policy, tmp_path, importance_sampling=False, **settings)
        assert ("old_per_token_logps" in trl["inputs"]) == (num_iterations == 2)
        diff = differences(mine, trl)
        assert max(diff.values()) <= RTOL, diff
        assert abs(mine["metrics"]["is_weight_mean"] - 1) < 1e-5


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ({"loss_type": "dapo"}, {"loss_type": "grpo"}),
        ({"loss_type": "grpo"}, {"loss_type": "dr_grpo"}),
        ({"scale_rewards": "group"}, {"scale_rewards": "batch"}),
        ({"beta": 0.04}, {"beta": 0.04, "use_bias_correction_kl": False}),
        ({"num_iterations": 2, "importance_sampling_cap": 2.0}, {"num_iterations": 2}),
        ({"num_iterations": 2, "epsilon_high": EPSILON}, {"num_iterations": 2}),
    ],
    ids=["loss_type", "dr_grpo", "scale_rewards", "kl_correction", "is_cap", "epsilon_high"],
)
def test_the_comparison_detects_a_different_update(policy_dir, tiny_model_dir, rollouts, tmp_path, monkeypatch, ours,
                                                    theirs):
    """One setting differs between the two sides: the parity check must see it, far above its tolerance."""
    common = dict(loss_type="dapo", beta=0.0, num_iterations=1, scale_rewards="group")
    mine = project_update(policy_dir, tiny_model_dir, rollouts, tmp_path, monkeypatch, **{**common, **ours})
    trl = trl_update(policy_dir, tiny_model_dir, rollouts, tmp_path, **{**common, **theirs})
    diff = differences(mine, trl)
    assert max(diff.values()) > 100 * RTOL, diff
