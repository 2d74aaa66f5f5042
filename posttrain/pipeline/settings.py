"""Typed parameters of the flows (their deployments enforce these schemas)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from posttrain.chain.format import MAX_CHAIN_DELTAS, Flavor
from posttrain.rollouts.shard import RolloutSettings
from posttrain.trainer.config import TrainerConfig

# At most 36 characters: each flow run appends "-<8 hex>" and job names must stay DNS labels.
RUN_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,34}[a-z0-9])?$")
BLOCK_REF = r"^[a-z0-9][a-z0-9-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$"  # <block-type-slug>/<name>

# Fields the flows fill in themselves.
_FILLED = {"mode", "model_name_or_path", "output_dir", "dataset_manifest", "rollouts"}

#: Trainer settings a flow run may override (names and meanings as in TRL); unset means the default.
TrainerSettings = create_model(
    "TrainerSettings",
    __config__=ConfigDict(extra="forbid"),
    **{
        name: (Optional[field.annotation], Field(None, description=field.description))  # noqa: UP007
        for name, field in TrainerConfig.model_fields.items()
        if name not in _FILLED
    },
)


# Placeholders for what the flows fill in, to check the overrides as soon as settings are given.
_PLACEHOLDERS = {"model_name_or_path": "/model", "output_dir": "/output", "dataset_manifest": "/manifest.json",
                 "rollouts": "/rollouts.jsonl"}


def check_trainer(settings: BaseModel, mode: str) -> BaseModel:
    """Validate trainer overrides as the trainer will; errors name trainer.<field>."""
    try:
        trainer_config(settings, mode=mode, **_PLACEHOLDERS)
    except ValidationError as e:
        problems = "; ".join(
            f"trainer.{'.'.join(str(p) for p in err['loc']) or '(settings)'}: {err['msg']}" for err in e.errors()
        )
        raise ValueError(problems) from None
    return settings


def trainer_config(settings: BaseModel, **filled) -> TrainerConfig:
    """A TrainerConfig from the flow's overrides plus what the flow fills in."""
    values = {k: v for k, v in settings.model_dump().items() if v is not None}
    return TrainerConfig(**values, **filled)


class PublishSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flavor: Flavor = Field(Flavor.COREWEAVE, description="Chain flavour: coreweave or slime.")
    max_deltas: int = Field(MAX_CHAIN_DELTAS, ge=0, le=MAX_CHAIN_DELTAS, description="Deltas after a full snapshot before the next full one.")
    delta_budget: float = Field(1.0, gt=0, description="Delta bytes allowed since a full snapshot, in full snapshots.")
    max_shard_size: int = Field(1 << 30, gt=0, description="Shard size limit in bytes.")
    retention: bool = Field(False, description="Delete chains superseded by a newer full snapshot.")


class RunSettings(BaseModel):
    """What every pipeline run needs: names, places, and the blocks to use."""

    model_config = ConfigDict(extra="forbid")

    run_name: str = Field(
        description="Run name (lowercase letters, digits, dashes); names folders and identities.",
        json_schema_extra={"pattern": RUN_NAME_RE.pattern},  # so an enforced deployment schema checks it too
    )
    base_model: str = Field(description="Absolute path of the model to start from (a Hugging Face folder).")
    dataset: str = Field(description="Absolute path of a JSONL or Parquet file of conversational prompts.")
    shared_dir: str = Field(description="Absolute folder on storage the cluster and the flow both see.")
    cluster: str = Field("posttrain-local-cluster/default", pattern=BLOCK_REF,
                         description="Cluster block: <block-type-slug>/<name>.")
    store: str = Field("posttrain-object-store/default", pattern=BLOCK_REF,
                       description="Object store block: <slug>/<name>.")
    inference: str | None = Field(
        "posttrain-inference-deployment/default", pattern=BLOCK_REF,
        description="Inference deployment block, or null for none.",
    )
    publish: PublishSettings = Field(default_factory=PublishSettings, description="Chain policy and layout.")

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, v: str) -> str:
        if not RUN_NAME_RE.fullmatch(v):
            raise ValueError("must be 1-36 lowercase letters, digits or dashes, starting and ending alphanumeric")
        return v

    @field_validator("base_model", "dataset", "shared_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not Path(v).is_absolute():
            raise ValueError(f"{v!r} is not an absolute path")
        return v

    @property
    def run_dir(self) -> Path:
        return Path(self.shared_dir) / "runs" / self.run_name

    def for_flow_run(self, flow_run_id: str | None):
        """These settings with the run name made unique to one flow run (and stable across its
        retries): nightly runs of one deployment never share a run folder, a job or a chain."""
        suffix = (flow_run_id or "").replace("-", "")[:8] or "local"
        return self.model_copy(update={"run_name": f"{self.run_name}-{suffix}"})


class NightlySettings(RunSettings):
    """The nightly post-training run: stage, train, publish and hot-load every checkpoint."""

    trainer: TrainerSettings = Field(default_factory=TrainerSettings, description="TRL GRPO settings.")
    watch_poll_s: float = Field(2.0, gt=0, description="Seconds between looks for new checkpoints.")

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, v: BaseModel) -> BaseModel:
        return check_trainer(v, "grpo")


class GrpoSettings(RunSettings):
    """GRPO with rollouts sampled from the inference deployment, round by round."""

    rounds: int = Field(2, ge=1, description="GRPO rounds (publish, hot-load, sample, train).")
    prompts_per_round: int = Field(8, ge=1, description="Prompts sampled per round.")
    shards: int = Field(2, ge=1, description="Rollout shards per round, sampled concurrently.")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="Sampling and rewards.")
    trainer: TrainerSettings = Field(default_factory=TrainerSettings, description="Settings of the training step.")

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, v: BaseModel) -> BaseModel:
        return check_trainer(v, "step")

    @field_validator("inference")
    @classmethod
    def _inference(cls, v: str | None) -> str | None:
        if v is None:
            raise ValueError("GRPO samples its rollouts from an inference deployment: name its block")
        return v


def flow_run_name() -> str:
    """A flow run's name (the flows' ``flow_run_name``): the user-given run name and the day it was
    scheduled for, e.g. ``nightly-2026-11-30``, rather than a random name."""
    from datetime import UTC, datetime

    from prefect.runtime import flow_run

    settings = (flow_run.parameters or {}).get("settings")
    name = settings.get("run_name") if isinstance(settings, dict) else getattr(settings, "run_name", None)
    when = flow_run.scheduled_start_time or datetime.now(UTC)
    return f"{name or flow_run.flow_name}-{when:%Y-%m-%d}"
