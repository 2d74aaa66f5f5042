"""The pieces of one GRPO update on rollouts sampled elsewhere, which ``trainer/policy.py``'s
``PolicyTrainer`` is built on (``mode: step`` and ``mode: resident`` through it): the checkpoint's
``trainer_state.json`` (``PolicyState``) and position, the staleness rule, the micro-batches, loading
the policy (with LoRA, its adapter and base reference) and its AdamW state, the optimizer steps of
the clipped objective with truncated importance weights, and the atomic checkpoint write."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.fsutil import publish_dir, staging_dir
from posttrain.lora.adapter import BaseRef, LoraError, base_fingerprint, is_adapter_dir, read_adapter, write_base_ref
from posttrain.rollouts.format import Rollout, RolloutError
from posttrain.trainer import distributed, precision
from posttrain.trainer.checkpoints import TRAINER_STATE_FILE
from posttrain.trainer.config import TrainerConfig
from posttrain.trainer.grpo_math import (
    aggregate_loss,
    per_token_policy_loss,
    token_logps,
    truncated_importance_weights,
)
from posttrain.trainer.probe import write_checkpoint_probe

OPTIMIZER_FILE = "optimizer.pt"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class StepError(RuntimeError):
    """A step cannot run or its output folder holds something else; the message names the path."""


class PolicyState(BaseModel):
    """``trainer_state.json`` of a checkpoint written by a step: where it came from and what it did."""

    model_config = ConfigDict(extra="forbid")

    global_step: int = Field(ge=0, description="Optimizer steps since the base model.")
    policy_version: int = Field(ge=0, description="Version of this policy; the input's version + 1.")
    source_checkpoint: str = Field(description="The policy folder this step started from.")
    rollouts: str = Field(description="The rollouts file trained on.")
    rollouts_sha256: str = Field(description="SHA-256 of the rollouts file.")
    rollouts_used: int = Field(ge=0, description="Rollouts that entered the loss.")
    rollouts_dropped_stale: int = Field(ge=0, description="Rollouts dropped as older than max_staleness.")
    metrics: dict[str, float] = Field(description="Loss, gradient norm, rewards and importance-weight statistics.")
    created: datetime = Field(description="When the checkpoint was written (UTC).")


def policy_position(model_dir: Path) -> tuple[int, int]:
    """(global_step, policy_version) of a policy folder: from its trainer_state.json, else (0, 0).

    A Hugging Face Trainer checkpoint records no policy version; each of its steps was one
    policy update, so its version is its global step.
    """
    path = model_dir / TRAINER_STATE_FILE
    if not path.exists():
        return 0, 0
    state = json.loads(path.read_text())
    step = int(state.get("global_step", 0))
    return step, int(state.get("policy_version", step))


def select_fresh(rollouts: list[Rollout], current_version: int, max_staleness: int) -> tuple[list[Rollout], int]:
    """Rollouts sampled at most ``max_staleness`` versions before ``current_version``, and how many were dropped."""
    future = sorted({r.policy_version for r in rollouts if r.policy_version > current_version})
    if future:
        raise RolloutError(
            f"rollouts carry policy_version {future} newer than the policy being trained ({current_version})"
        )
    fresh = [r for r in rollouts if r.policy_version >= current_version - max_staleness]
    return fresh, len(rollouts) - len(fresh)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T], right-padded
    attention_mask: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T-1], 1 where position t predicts a completion token
    behaviour_logps: torch.Tensor  # [B, T-1], zeros off the mask
    advantages: torch.Tensor  # [B]


def collate(rollouts: list[Rollout], advantages: list[float], pad_id: int) -> MicroBatch:
    """Right-padded prompt+completion sequences with the completion mask and behaviour log-probs."""
    length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    n = len(rollouts)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length - 1))
    behaviour = torch.zeros((n, length - 1))
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids)
        attention_mask[i, : p + c] = 1
        mask[i, p - 1 : p - 1 + c] = 1  # position t predicts token t+1
        behaviour[i, p - 1 : p - 1 + c] = torch.tensor(r.logprobs)
    return MicroBatch(input_ids, attention_mask, mask, behaviour, torch.tensor(advantages, dtype=torch.float32))


def load_policy(model_dir: Path, config: TrainerConfig, dtype):
    """The policy to train and, with LoRA, its base reference. With ``lora``, ``model_dir`` is the base
    (a new adapter starts) or the previous step's adapter checkpoint (training continues on it)."""
    from transformers import AutoModelForCausalLM

    adapter_dir = is_adapter_dir(model_dir)
    if config.lora is None:
        if adapter_dir:
            raise StepError(f"model_name_or_path {str(model_dir)!r} is a LoRA adapter: set lora to train it")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if dtype == torch.float32:  # a checkpoint saved coarser than it was trained: go on from its float32 weights
            try:
                precision.load_master(model, model_dir)
            except ValueError as e:
                raise StepError(str(e)) from None
        return model, None
    from peft import PeftModel, get_peft_model

    if not adapter_dir:
        base_ref = BaseRef(path=str(model_dir), fingerprint=base_fingerprint(model_dir))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return get_peft_model(model, config.lora.peft_config()), base_ref
    try:
        adapter = read_adapter(model_dir)
    except LoraError as e:
        raise StepError(str(e)) from None
    got = {k: adapter.config.get(k) for k in ("r", "lora_alpha")}
    if got != {"r": config.lora.r, "lora_alpha": config.lora.lora_alpha}:
        raise StepError(f"{model_dir}: adapter has {got}, the config asks for r={config.lora.r}, "
                        f"lora_alpha={config.lora.lora_alpha}")
    base = adapter.base_path
    base_ref = adapter.base or BaseRef(path=base, fingerprint=base_fingerprint(base))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, model_dir, is_trainable=True), base_ref


def train(model, ref_model, optimizer, batches, mine, config, stop_event, device) -> dict[str, float] | None:
    """``num_iterations`` optimizer steps over all micro-batches (this rank's share ``mine``; gradients
    and metrics summed over ranks); None when stopped before the end."""
    total_tokens = float(sum(b.mask.sum() for b in batches))
    total_sequences = sum(b.advantages.shape[0] for b in batches)
    batches = mine
    eps_high = config.epsilon_high if config.epsilon_high is not None else config.epsilon

    def logps(m, b):
        logits = m(input_ids=b.input_ids.to(device), attention_mask=b.attention_mask.to(device)).logits
        return token_logps(logits, b.input_ids.to(device), config.temperature)

    with torch.no_grad():
        old = [logps(model, b) for b in batches]  # pi_old: the policy before this update
        ref = [logps(ref_model, b) for b in batches] if ref_model is not None else [None] * len(batches)

    metrics: dict[str, float] = {}
    for _ in range(config.num_iterations):
        if distributed.any_rank(stop_event.is_set(), device):
            return None
        optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", "is_weight", "is_capped", "clipped", "old_minus_behaviour"), 0.0)
        for batch, old_logps, ref_logps in zip(batches, old, ref, strict=True):
            mask = batch.mask.to(device)
            behaviour = batch.behaviour_logps.to(device)
            new_logps = logps(model, batch)
            weights = truncated_importance_weights(old_logps, behaviour, config.importance_sampling_cap)
            token_loss = per_token_policy_loss(
                new_logps,
                old_logps,
                batch.advantages.to(device),
                epsilon_low=config.epsilon,
                epsilon_high=eps_high,
                is_weights=weights,
                ref_logps=ref_logps,
                beta=config.beta,
            )
            loss = aggregate_loss(
                token_loss,
                mask,
                config.loss_type,
                total_tokens=total_tokens,
                total_sequences=total_sequences,
                max_completion_length=config.max_completion_length,
            )
            loss.backward()
            with torch.no_grad():
                ratio = torch.exp(new_logps - old_logps)
                clipped = (ratio < 1 - config.epsilon) | (ratio > 1 + eps_high)
                sums["loss"] += loss.item()
                sums["is_weight"] += float((weights * mask).sum())
                sums["is_capped"] += float(((weights >= config.importance_sampling_cap).float() * mask).sum())
                sums["clipped"] += float((clipped.float() * mask).sum())
                sums["old_minus_behaviour"] += float(((old_logps - behaviour) * mask).sum())
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # a rank without a micro-batch still takes part in the sum
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        distributed.all_reduce_sum([p.grad for p in params])
        totals = torch.tensor([sums[k] for k in sums], dtype=torch.float64, device=device)
        distributed.all_reduce_sum([totals])
        sums = dict(zip(sums, totals.tolist(), strict=True))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        tokens = max(total_tokens, 1.0)
        metrics = {
            "loss": sums["loss"],
            "grad_norm": float(grad_norm),
            "is_weight_mean": sums["is_weight"] / tokens,
            "is_capped_fraction": sums["is_capped"] / tokens,
            "clip_fraction": sums["clipped"] / tokens,
            "mean_logp_old_minus_behaviour": sums["old_minus_behaviour"] / tokens,
            "completion_tokens": total_tokens,
        }
    return metrics


def check_token_ids(rollouts: list[Rollout], vocab: int, path) -> None:
    top = max(max(r.prompt_ids + r.completion_ids) for r in rollouts)
    if top >= vocab:
        raise RolloutError(f"{path}: token id {top} is outside the model's vocabulary of {vocab}")


def load_optimizer_state(optimizer, model_dir: Path, config: TrainerConfig) -> bool:
    """Restore AdamW moments saved by the previous step; False when there are none to restore.

    Only step checkpoints qualify: a Hugging Face Trainer's optimizer.pt groups parameters differently.
    """
    path = model_dir / OPTIMIZER_FILE
    try:
        PolicyState.model_validate_json((model_dir / TRAINER_STATE_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    if not path.exists():
        return False
    try:
        optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except (ValueError, RuntimeError, KeyError) as e:
        raise StepError(f"{path}: optimizer state does not fit the model ({e})") from None
    for group in optimizer.param_groups:  # the config, not the saved state, sets the rate
        group["lr"] = config.learning_rate
        group["weight_decay"] = config.weight_decay
    return True


def save_atomically(model, optimizer, model_dir: Path, target: Path, state: PolicyState,
                     base_ref: BaseRef | None = None, save_dtype: torch.dtype | None = None) -> None:
    """Write the checkpoint under a temporary name, sync it, then rename it into place. With LoRA,
    ``save_pretrained`` writes the adapter only, and the base reference goes beside it. The weights
    are saved in ``save_dtype`` (None: as trained), with the float32 ones beside them when that is
    coarser (``posttrain.trainer.precision``); the probe is computed on the weights as saved."""
    saved = model
    if base_ref is None and save_dtype is not None:
        saved = precision.saved_model(model, save_dtype)
    # one writer per step: a staging folder left by a killed attempt is removed
    with staging_dir(target, clear_leftovers=True) as tmp:
        saved.save_pretrained(tmp)
        if saved is not model and precision.is_coarser(save_dtype, next(model.parameters()).dtype):
            precision.save_master(model, tmp)
        if base_ref is not None:
            write_base_ref(tmp, base_ref)
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        # rank 0's model is a full replica of the weights just saved (gradients are summed over ranks)
        write_checkpoint_probe(saved, tmp)  # before trainer_state.json, which completes the checkpoint
        (tmp / TRAINER_STATE_FILE).write_text(state.model_dump_json(indent=2) + "\n")
        publish_dir(tmp, target, sync_files=True)
