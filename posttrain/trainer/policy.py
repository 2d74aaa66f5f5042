"""The policy being trained and its optimizer, in memory: what ``mode: step`` (load, one update, save)
and ``mode: resident`` (load once, then an update and a save per round) share, on top of
``trainer/grpo_update.py``'s pieces (loading, the clipped objective with truncated importance
weights, the atomic checkpoint). From the same policy and rollouts, both modes write the same checkpoint."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from posttrain.lora.adapter import BaseRef
from posttrain.rollouts.format import Rollout, RolloutError
from posttrain.rollouts.scoring import group_advantages
from posttrain.trainer import distributed, grpo_update, precision, timeline  # grpo_update.<x> when called: tests replace some
from posttrain.trainer.config import TrainerConfig


@dataclass
class Selection:
    """The rollouts one update trains on: those fresh enough for the policy version trained, with their advantages."""

    source: Path  # the rollouts file
    sha256: str
    version: int  # the policy version trained
    fresh: list[Rollout]
    dropped: int
    advantages: list[float]


def select_update(rollouts: list[Rollout], sha256: str, source: Path, version: int,
                  config: TrainerConfig) -> Selection:
    """Drop the stale rollouts and score the rest; RolloutError when none is fresh enough."""
    fresh, dropped = grpo_update.select_fresh(rollouts, version, config.max_staleness)
    if not fresh:
        raise RolloutError(
            f"{source}: all {len(rollouts)} rollouts are more than max_staleness="
            f"{config.max_staleness} versions older than policy version {version}"
        )
    advantages = group_advantages([r.reward for r in fresh], [r.group_id for r in fresh], config.scale_rewards)
    return Selection(source, sha256, version, fresh, dropped, advantages)


class PolicyTrainer:
    """The policy and its AdamW state in memory, shared by ``mode: step`` (load, one update, save) and
    ``mode: resident`` (load once, then an update and a save per round). Every rank holds the same
    policy: gradients are summed over ranks, so the ranks' copies stay equal without reloading."""

    def __init__(self, config: TrainerConfig, stop_event: threading.Event):
        self.config = config
        self.stop_event = stop_event
        self.device = None
        self.model = None
        self.ref_model = None
        self.optimizer = None
        self.base_ref: BaseRef | None = None
        self.source: Path | None = None  # the folder the policy in memory was loaded from or saved as
        self.tokenizer_dir: Path | None = None  # where the checkpoints' tokenizer files come from
        self.global_step = 0
        self.policy_version = 0
        self.optimizer_restored = False
        self.save_dtype: torch.dtype | None = None  # what checkpoints hold (config.save_dtype resolved at load)

    def load(self, model_dir: Path) -> None:
        """Load the policy of ``model_dir`` (weights, LoRA adapter, the optimizer state of a step checkpoint)."""
        from transformers import AutoModelForCausalLM

        config = self.config
        self.device = distributed.init(config.use_cpu)
        dtype = torch.bfloat16 if config.bf16 else torch.float32
        torch.manual_seed(config.seed)
        model, self.base_ref = grpo_update.load_policy(model_dir, config, dtype)
        if self.save_dtype is None:  # the first folder loaded is the base (or its first checkpoint): its dtype
            self.save_dtype = precision.resolve_save_dtype(config.save_dtype, model_dir)
        self.model = model.to(self.device)
        self.model.eval()  # no dropout: the ratio must compare the same function before and after the update
        if config.beta > 0 and self.ref_model is None:
            ref_model = AutoModelForCausalLM.from_pretrained(config.ref_model_name_or_path, dtype=dtype)
            self.ref_model = ref_model.to(self.device)
            self.ref_model.eval()
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # all of them, or the adapter's
        self.optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.optimizer_restored = grpo_update.load_optimizer_state(self.optimizer, model_dir, config)
        self.global_step, self.policy_version = grpo_update.policy_position(model_dir)
        self.source = self.tokenizer_dir = model_dir
        timeline.current().mark("loaded", step=self.global_step)  # goodput: start-up ends (rank 0's record)

    def update(self, selection: Selection) -> dict[str, float] | None:
        """One GRPO update (``num_iterations`` optimizer steps) on the selected rollouts; its metrics,
        or None when a stop request came first (the policy in memory is then part-updated: not to save)."""
        config, fresh, version = self.config, selection.fresh, selection.version
        if version != self.policy_version:
            raise grpo_update.StepError(f"{selection.source}: selected for policy version {version}, "
                                        f"the policy in memory is version {self.policy_version}")
        grpo_update.check_token_ids(fresh, self.model.get_input_embeddings().num_embeddings, selection.source)
        pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        size = config.per_device_train_batch_size
        advantages = selection.advantages
        batches = [grpo_update.collate(fresh[i : i + size], advantages[i : i + size], pad_id)
                   for i in range(0, len(fresh), size)]
        ranks = distributed.ranks()
        mine = batches[ranks.rank :: ranks.world_size]  # this rank's share; the totals stay the whole batch's
        with timeline.current().span("step", step=self.global_step + config.num_iterations):
            metrics = grpo_update.train(self.model, self.ref_model, self.optimizer, batches, mine, config,
                                        self.stop_event, self.device)
        if metrics is None:
            return None
        metrics.update(
            mean_reward=sum(r.reward for r in fresh) / len(fresh),
            rollouts_used=float(len(fresh)),
            rollouts_dropped_stale=float(selection.dropped),
            staleness_mean=sum(version - r.policy_version for r in fresh) / len(fresh),
            staleness_max=float(max(version - r.policy_version for r in fresh)),
            optimizer_state_restored=float(self.optimizer_restored),
        )
        self.optimizer_restored = True  # the next update goes on with these moments
        self.global_step += config.num_iterations
        self.policy_version += 1
        return metrics

    def state(self, selection: Selection, metrics: dict[str, float]) -> grpo_update.PolicyState:
        """The trainer_state.json of the policy in memory, just updated on ``selection``."""
        return grpo_update.PolicyState(
            global_step=self.global_step,
            policy_version=self.policy_version,
            source_checkpoint=str(self.source),
            rollouts=str(selection.source),
            rollouts_sha256=selection.sha256,
            rollouts_used=len(selection.fresh),
            rollouts_dropped_stale=selection.dropped,
            metrics=metrics,
            created=datetime.now(UTC),
        )

    def save(self, target: Path, state: grpo_update.PolicyState) -> None:
        """Write the policy in memory as the checkpoint ``target``, atomically (rank 0 only; the
        caller waits for it on every rank with ``distributed.barrier``)."""
        if distributed.ranks().is_main:
            with timeline.current().span("save", step=state.global_step):
                grpo_update.save_atomically(self.model, self.optimizer, self.tokenizer_dir, target, state,
                                            self.base_ref, self.save_dtype)
        self.source = target
