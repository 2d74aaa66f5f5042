"""The trainer's YAML config and its result. Field names follow TRL's GRPOConfig where they exist."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.errors import validation_problems
from posttrain.rollouts.scoring import REWARD_FUNC_PATTERN, REWARD_FUNCS_SCHEMA


#: A tracker name as transformers' ``report_to`` takes it (``none``, ``tensorboard``, ``wandb``, ``azure_ml``, ...).
TRACKER_PATTERN = r"^[a-z][a-z0-9_]*$(?!\n)"


class ConfigError(ValueError):
    """The trainer config file is missing, not YAML, or fails validation (the message names the fields)."""


class LoraSettings(BaseModel):
    """A LoRA adapter to train instead of all weights (peft's ``LoraConfig`` names and meanings)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, description="LoRA rank: the inner dimension of each A/B pair.")
    lora_alpha: float = Field(32, gt=0, description="LoRA scale numerator: the update is (lora_alpha / r) B @ A.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1,
        description="Linear modules that get an adapter, by name suffix (e.g. q_proj, v_proj, down_proj).",
    )

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=list(self.target_modules), bias="none", task_type="CAUSAL_LM")


#: The trainer's modes. A field's description starts with the modes it belongs to when it is not for all
#: of them ("step, resident: ..."); ``posttrain.pipeline.settings.trainer_settings`` reads these labels.
MODES = ("grpo", "step", "resident")


class TrainerConfig(BaseModel):
    """One training run on a node: ``mode: grpo`` (TRL generates), ``mode: step`` (one update on rollouts
    from elsewhere) or ``mode: resident`` (a GRPO run's every update, one round after the other)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["grpo", "step", "resident"] = Field(
        "grpo",
        description="grpo: a TRL GRPOTrainer run that generates its own completions; "
        "step: one GRPO update on rollouts sampled elsewhere; "
        "resident: one job for all rounds of a GRPO run, each round's rollouts handed in rounds_dir.",
    )
    model_name_or_path: str = Field(
        description="Model to train: a Hugging Face folder (absolute path on shared storage) or hub id. "
        "In step mode, the folder of the current policy checkpoint; in resident mode, the initial policy's."
    )
    output_dir: Path = Field(description="Absolute folder that receives checkpoint-<step>/ folders.")
    dataset_manifest: Path | None = Field(
        None, description="grpo: absolute path of a staged dataset's manifest.json (posttrain stage)."
    )
    rollouts: Path | None = Field(None, description="step: absolute path of the rollouts JSONL file.")
    rounds_dir: Path | None = Field(
        None, description="resident: absolute folder where the flow hands rounds: <rounds_dir>/<round:04d>/"
        "rollouts.jsonl, then ready.json (posttrain.trainer.rounds).",
    )
    rounds: int | None = Field(None, ge=1, description="resident: how many rounds (updates) the run has.")
    round_timeout_s: float = Field(
        3600.0, gt=0, description="resident: seconds to wait for a round's ready.json after the flow's heartbeat "
        "(rounds_dir/flow-heartbeat.json) last changed, or after the wait began, before the job ends with an "
        "error naming the round, its folder and the heartbeat's age.",
    )
    reward_funcs: list[str] = Field(
        default_factory=list,
        description="grpo: reward functions as 'module:function' import paths, "
        "e.g. posttrain.rewards:correctness_reward.",
        json_schema_extra=REWARD_FUNCS_SCHEMA,
    )
    reward_weights: list[float] | None = Field(
        None, description="grpo: one weight per reward function; None weighs them all 1.0."
    )

    learning_rate: float = Field(1e-6, gt=0, description="Peak AdamW learning rate.")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear",
        description="grpo: learning-rate schedule over max_steps. step and resident modes use a constant rate.",
    )
    warmup_steps: int = Field(0, ge=0, description="grpo: steps of linear warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    per_device_train_batch_size: int = Field(
        8, ge=1,
        description="grpo: completions (not prompts) per device per step. step, resident: rollouts per micro-batch.",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="grpo: micro-batches per optimizer step.")
    num_generations: int = Field(8, ge=2, description="grpo: completions sampled per prompt (the group size G).")
    max_completion_length: int = Field(
        256, ge=1, description="grpo: most tokens generated per completion; also the dr_grpo normalizer."
    )
    max_steps: int | None = Field(None, ge=1, description="grpo: total optimizer steps of the run (required).")
    save_steps: int = Field(100, ge=1, description="grpo: save a checkpoint every this many steps (and at the end).")
    save_total_limit: int | None = Field(
        None, ge=1, description="grpo: keep at most this many checkpoints, deleting the oldest."
    )
    seed: int = Field(0, description="Random seed.")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; step and resident modes scale logits by it too."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="grpo: nucleus sampling threshold.")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the reference model; 0 loads no reference.")
    ref_model_name_or_path: str | None = Field(
        None, description="step, resident: reference model for the KL term, required when beta > 0."
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip range of the policy ratio.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip range; None uses epsilon.")
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = Field(
        "dapo",
        description="Loss aggregation: dapo = mean over all completion tokens; grpo = mean per sequence, "
        "then over sequences; dr_grpo = token sum / (sequences x max_completion_length).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's reward std, the batch's, or not at all."
    )
    num_iterations: int = Field(1, ge=1, description="Optimizer passes over each batch (PPO epochs, mu).")
    importance_sampling_cap: float = Field(
        2.0, ge=1, description="step, resident: cap on the truncated importance weight pi_old / pi_behaviour per token."
    )
    max_staleness: int = Field(
        1, ge=0, description="step, resident: drop rollouts sampled more than this many policy versions older than the "
        "policy being trained."
    )
    logging_steps: int = Field(1, ge=1, description="grpo: log metrics every this many steps.")
    report_to: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Trackers that receive the training metrics (TRL's report_to): tensorboard, wandb, mlflow, "
        "trackio, ... or none. TensorBoard event files go to logging_dir. grpo: TRL logs every logging_steps; "
        "step, resident: one point per update, at step = the policy version trained from (the round).",
        json_schema_extra={"items": {"type": "string", "pattern": TRACKER_PATTERN}},
    )
    run_name: str | None = Field(
        None, description="Run name the trackers show (TRL's run_name; wandb, mlflow, trackio); None: theirs."
    )
    logging_dir: Path | None = Field(
        None, description="Absolute folder of the TensorBoard event files; None: the folder tensorboard beside "
        "output_dir (output_dir/../tensorboard), which every job of a run shares.",
    )
    bf16: bool = Field(False, description="Train in bfloat16 (needs a GPU or a CPU with bf16 support).")
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Dtype of the weights each checkpoint saves (what is published and served); auto: the "
        "base model's (config.json's dtype), so a bfloat16 model trained in float32 is saved in bfloat16, not at "
        "twice its size. When it is coarser than the training dtype, step and resident checkpoints also keep the "
        "float32 weights (master-weights.pt) that the next step or a resume goes on from.",
    )
    use_cpu: bool = Field(False, description="Train on the CPU even when a GPU is present.")
    gradient_checkpointing: bool = Field(False, description="grpo: trade compute for activation memory.")
    lora: LoraSettings | None = Field(
        None, description="Train a LoRA adapter (peft) instead of all weights; each checkpoint is the adapter "
        "plus a reference to its base. None trains all weights.",
    )

    @field_validator("output_dir", "dataset_manifest", "rollouts", "rounds_dir", "logging_dir")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"must be an absolute path on shared storage, got {str(value)!r}")
        return value

    @field_validator("reward_funcs")
    @classmethod
    def _import_paths(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not re.fullmatch(REWARD_FUNC_PATTERN, v)]
        if bad:
            raise ValueError(f"expected 'module:function' import paths, got {bad}")
        return value

    @field_validator("report_to")
    @classmethod
    def _trackers(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not re.fullmatch(TRACKER_PATTERN, v)]
        if bad:
            raise ValueError(f"expected tracker names such as tensorboard, wandb, mlflow, trackio or none, got {bad}")
        if "none" in value and len(value) > 1:
            raise ValueError("none: give it alone (no tracker), not with other trackers")
        return value

    @property
    def trackers(self) -> list[str]:
        """The trackers to report to: report_to less "none"."""
        return [t for t in self.report_to if t != "none"]

    @property
    def tensorboard_dir(self) -> Path:
        """Where the TensorBoard event files go: logging_dir, else tensorboard/ beside output_dir."""
        return self.logging_dir or self.output_dir.parent / "tensorboard"

    @model_validator(mode="after")
    def _mode_fields(self) -> TrainerConfig:
        problems = []
        if self.mode == "grpo":
            for name in ("dataset_manifest", "max_steps"):
                if getattr(self, name) is None:
                    problems.append(f"{name}: required when mode is grpo")
            if not self.reward_funcs:
                problems.append("reward_funcs: at least one is required when mode is grpo")
            completions = self.per_device_train_batch_size * self.gradient_accumulation_steps
            if completions % self.num_generations:
                problems.append(
                    f"per_device_train_batch_size x gradient_accumulation_steps ({completions}) must be a "
                    f"multiple of num_generations ({self.num_generations})"
                )
        else:
            if self.mode == "step" and self.rollouts is None:
                problems.append("rollouts: required when mode is step")
            if self.mode == "resident":
                for name in ("rounds_dir", "rounds"):
                    if getattr(self, name) is None:
                        problems.append(f"{name}: required when mode is resident")
                if self.rollouts is not None:
                    problems.append("rollouts: not used when mode is resident (each round's are in rounds_dir)")
            if self.beta > 0 and self.ref_model_name_or_path is None:
                problems.append(f"ref_model_name_or_path: required when mode is {self.mode} and beta > 0")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            problems.append(
                f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class TrainingResult(BaseModel):
    """What a call of ``run_training`` achieved."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["grpo", "step", "resident"] = Field(description="The config's mode.")
    global_step: int = Field(ge=0, description="Optimizer steps taken in total, across restarts.")
    policy_version: int | None = Field(
        None, description="step, resident: policy version of the last checkpoint written (input version + 1 "
        "per update)."
    )
    checkpoint: Path | None = Field(None, description="The last complete checkpoint in output_dir.")
    resumed_from: Path | None = Field(
        None, description="Checkpoint this call resumed from; None when it started fresh."
    )
    completed: bool = Field(
        description="True when the run reached its end (max_steps; the step is saved; the last round is saved)."
    )
    stopped_early: bool = Field(False, description="True when a stop request (SIGTERM, requeue) ended it early.")
    already_done: bool = Field(False, description="True when an earlier attempt had finished; nothing was trained.")
    rounds_done: int | None = Field(
        None, description="resident: rounds whose checkpoint is written, this attempt's and earlier ones'."
    )
    metrics: dict[str, float] = Field(default_factory=dict, description="Final training metrics.")


def load_trainer_config(path: str | os.PathLike[str]) -> TrainerConfig:
    """Read and validate a trainer YAML file; errors name the file and the fields at fault."""
    import yaml

    path = Path(path)
    try:
        data: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of trainer settings")
    try:
        return TrainerConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  - {line}" for line in validation_problems(e)]
        raise ConfigError(f"{path}: invalid trainer config:\n" + "\n".join(lines)) from None
