"""Typed parameters of the flows (their deployments enforce these schemas)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

from annotated_types import MinLen
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_core import PydanticUndefined

from posttrain.chain.errors import FormatError
from posttrain.chain.format import MAX_CHAIN_DELTAS, Flavor, check_identity
from posttrain.pipeline.blocks import InferenceDeployment, KubernetesCluster, LocalCluster, ObjectStore, SlurmCluster
from posttrain.pipeline.promotion_settings import PromotionSettings
from posttrain.pipeline.refs import ABSOLUTE, BLOCK_REF, block_ref, whole_value
from posttrain.polling import MIN_POLL_S
from posttrain.rollouts.shard import RolloutSettings
from posttrain.trainer.config import MODES, LoraSettings, TrainerConfig

# At most 36 characters: each flow run appends "-<8 hex>" and job names must stay DNS labels. (No
# bracket starts with a letter: Prefect's CLI prints the pattern through rich, which eats "[a-z...]".)
# "(?!\n)": Prefect checks a parameter against its schema's pattern with Python's re.search, where "$"
# also matches before a final newline; the lookahead refuses it (and JavaScript, the UI form's, compiles it).
RUN_NAME_RE = re.compile(r"^[0-9a-z]([-0-9a-z]{0,34}[0-9a-z])?$(?!\n)")
#: Parameters that name a block. The CLI gives ``<slug>/<name>``; the UI's run form also offers a
#: picker of the saved blocks of these types (Prefect passes a reference to the one picked).
# A Dask scheduler's address, protocol://host:port (tcp, tls, ucx, ws, wss); a pydantic pattern, as BLOCK_REF.
DASK_ADDRESS = r"^(tcp|tls|ucx|ws|wss)://[^\s/]+:[0-9]+$"
BLOCK_PARAMETERS = {"cluster": (LocalCluster, SlurmCluster, KubernetesCluster), "store": (ObjectStore,),
                    "inference": (InferenceDeployment,)}
#: Block parameters of promotion: the production deployment, the staging one (the promote flow's).
PROMOTION_BLOCK_PARAMETERS = {"promote_to": (InferenceDeployment,), "production": (InferenceDeployment,),
                              "staging": (InferenceDeployment,)}


# Fields the flows fill in themselves (``lora`` from the run's lora group; ``logging_dir``: the run
# folder's ``tensorboard``, which the artifacts name).
_FILLED = {"mode", "model_name_or_path", "output_dir", "dataset_manifest", "rollouts", "rounds_dir", "rounds", "lora",
           "logging_dir"}
# A label of the modes a description is about: "step:", "step, resident:" (at its start or after a space).
_MODE_LABEL = re.compile(r"(?:^|\s)((?:[a-z]+, )*[a-z]+):")
# Trainer fields under another name among the flat flow parameters (``run_name`` names the run there).
_RENAMED = {"run_name": "tracker_run_name"}
_RENAMED_DESCRIPTIONS = {
    "run_name": "Run name the trackers of report_to show (TRL's run_name; wandb, mlflow, trackio); "
    "null (None): the run's name (run_name with the flow run's suffix, as its folder).",
}


def trainer_settings(mode: str, *, exclude: frozenset[str] = frozenset(), required: tuple[str, ...] = ()):
    """The trainer settings a flow run of ``mode`` may set: TrainerConfig's fields (names, bounds,
    defaults and meanings as in TRL), less those the flow fills in and those of the other modes (a
    description that starts with a label of modes, "step, resident: ...", and names ``mode`` in none)."""
    fields = {}
    for name, field in TrainerConfig.model_fields.items():
        text = field.description or ""
        if name in _FILLED or name in exclude or not _for_mode(text, mode):
            continue
        info, annotation = copy.copy(field), field.annotation
        if name in required:  # no default, not null, not empty
            info.default, info.default_factory = PydanticUndefined, None
            if get_origin(annotation) in (Union, UnionType):
                annotation = next(a for a in get_args(annotation) if a is not type(None))
            if get_origin(annotation) is list:
                info.metadata = [*info.metadata, MinLen(1)]
        if name in _RENAMED:
            info.description = _RENAMED_DESCRIPTIONS[name]
        fields[_RENAMED.get(name, name)] = (annotation, info)
    return create_model(f"{mode.capitalize()}TrainerSettings", __config__=ConfigDict(extra="forbid"), **fields)


def _for_mode(description: str, mode: str) -> bool:
    labels = [m for m in _MODE_LABEL.finditer(description) if set(m.group(1).split(", ")) <= set(MODES)]
    if not labels or labels[0].start() != 0:
        return True  # about every mode
    return any(mode in m.group(1).split(", ") for m in labels)


#: The nightly run's trainer (TRL's GRPOTrainer); a run must say how long and what it rewards.
GrpoTrainerSettings = trainer_settings("grpo", required=("max_steps", "reward_funcs"))
#: A GRPO round's training step; its temperature is the rollouts' (the logprobs must match the sampling).
#: Its max_staleness is the flow's own (GrpoSettings.max_staleness): the bound the rounds are sampled under.
StepTrainerSettings = trainer_settings("step", exclude=frozenset({"temperature", "max_staleness"}))


# Placeholders for what the flows fill in, to check the trainer settings as soon as they are given.
_PLACEHOLDERS = {"model_name_or_path": "/model", "output_dir": "/output", "dataset_manifest": "/manifest.json",
                 "rollouts": "/rollouts.jsonl"}


def check_trainer(settings: BaseModel, mode: str) -> BaseModel:
    """Validate trainer settings as the trainer will; errors name the fields."""
    try:
        trainer_config(settings, mode=mode, **_PLACEHOLDERS)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) + ': ' if err['loc'] else ''}"
            f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors()
        )
        raise ValueError(problems) from None
    return settings


def trainer_config(settings: BaseModel, lora: LoraGroup | None = None, *, run_name: str | None = None,
                   **filled) -> TrainerConfig:
    """A TrainerConfig from the flow's trainer settings, the run's lora group and what the flow fills in;
    ``run_name`` (the run's) is the trackers' run name unless the settings give one (tracker_run_name)."""
    original = {flat: name for name, flat in _RENAMED.items()}
    values = {original.get(k, k): v for k, v in settings.model_dump().items()}
    if values.get("run_name") is None:
        values["run_name"] = run_name
    return TrainerConfig(**values, lora=lora.trainer_lora() if lora else None, **filled)


class PublishSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flavor: Flavor = Field(Flavor.COREWEAVE, description="Chain flavour: coreweave or slime.")
    max_deltas: int = Field(MAX_CHAIN_DELTAS, ge=0, le=MAX_CHAIN_DELTAS, description="Deltas after a full snapshot before the next full one.")
    delta_budget: float = Field(1.0, gt=0, description="Delta bytes allowed since a full snapshot, in full snapshots.")
    max_shard_size: int = Field(1 << 30, gt=0, description="Shard size limit in bytes.")
    retention: bool = Field(False, description="Delete chains superseded by a newer full snapshot.")


class GcSettings(BaseModel):
    """Retention across the runs of the store, as the run's last task (docs/retention.md): at most
    one of gc_keep_runs and gc_keep_days; neither is no gc."""

    model_config = ConfigDict(extra="forbid")

    gc_keep_runs: int | None = Field(None, ge=1, description="At the end of the run, keep the newest N runs of the "
                                     "store whole and delete what no kept or protected version needs; null: no gc.")
    gc_keep_days: float | None = Field(None, gt=0, description="At the end of the run, keep whole every run that "
                                       "published within D days (instead of gc_keep_runs); null: no gc.")
    gc_protect: list[str] = Field(default_factory=list, description="Snapshot identities gc keeps with their chain "
                                  "prefix, whatever their run (besides the promotion histories and what the "
                                  "inference deployment serves, always kept).")

    @field_validator("gc_protect")
    @classmethod
    def _identities(cls, v: list[str]) -> list[str]:
        for i, identity in enumerate(v):
            try:
                check_identity(identity, f"gc_protect[{i}]")
            except FormatError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _one_rule(self) -> GcSettings:
        if self.gc_keep_runs is not None and self.gc_keep_days is not None:
            raise ValueError("gc_keep_runs and gc_keep_days: give at most one of them (neither: no gc)")
        return self

    @property
    def enabled(self) -> bool:
        return self.gc_keep_runs is not None or self.gc_keep_days is not None


class LoraGroup(LoraSettings):
    """LoRA training (peft's names) and how its checkpoints are published."""

    use_lora: bool = Field(False, description="Train a LoRA adapter (r, lora_alpha, lora_dropout, target_modules) "
                           "instead of all weights.")
    lora_publish: Literal["merged", "adapter"] = Field(
        "merged", description="With use_lora: merged publishes base + adapter as full/delta snapshots of the model "
        "(any engine); adapter publishes the adapter alone (its own full/delta snapshots), which only a deployment "
        "that loads LoRA at run time can hot-load (posttrain serve --engine vllm --engine-max-lora-rank N); other "
        "deployments refuse it at hot-load, naming lora_publish.",
    )

    def trainer_lora(self) -> LoraSettings | None:
        """The trainer's lora section, or None without use_lora."""
        return LoraSettings(**self.model_dump(include=set(LoraSettings.model_fields))) if self.use_lora else None


class RunSettings(BaseModel):
    """What every pipeline run needs: names, places, and the blocks to use."""

    model_config = ConfigDict(extra="forbid")

    run_name: str = Field(
        description="Run name (lowercase letters, digits, dashes); names folders and identities.",
        json_schema_extra={"pattern": RUN_NAME_RE.pattern},  # so an enforced deployment schema checks it too
    )
    base_model: str = Field(description="Absolute path of the model to start from (a Hugging Face folder).",
                            json_schema_extra=ABSOLUTE)
    dataset: str = Field(description="Absolute path of a JSONL or Parquet file of conversational prompts.",
                         json_schema_extra=ABSOLUTE)
    shared_dir: str = Field(description="Absolute folder on storage the cluster and the flow both see.",
                            json_schema_extra=ABSOLUTE)
    # The descriptions are markdown in the UI's run form, which drops "<...>" as HTML: no angle brackets.
    cluster: str = Field("posttrain-local-cluster/default", pattern=BLOCK_REF, json_schema_extra=whole_value,
                         description="Cluster block, by `block-type-slug/block-name` "
                         "(e.g. `posttrain-slurm-cluster/sunk`), or a saved one picked by type.")
    store: str = Field("posttrain-object-store/default", pattern=BLOCK_REF, json_schema_extra=whole_value,
                       description="Object store block, by `block-type-slug/block-name` "
                       "(e.g. `posttrain-object-store/default`), or a saved one picked.")
    inference: str | None = Field(
        "posttrain-inference-deployment/default", pattern=BLOCK_REF, json_schema_extra=whole_value,
        description="Inference deployment block, by `block-type-slug/block-name` "
        "(e.g. `posttrain-inference-deployment/default`), or a saved one picked; null (None) for none.",
    )
    publish: PublishSettings = Field(default_factory=PublishSettings, description="Chain policy and layout.")
    lora: LoraGroup = Field(default_factory=LoraGroup, description="LoRA training and publishing.")

    _blocks = field_validator("cluster", "store", "inference", mode="before")(lambda cls, v: block_ref(v))

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
        return self.model_copy(update={"run_name": f"{self.run_name}-{run_suffix(flow_run_id)}"})


class NightlySettings(RunSettings):
    """The nightly post-training run: stage, train, publish and hot-load every checkpoint."""

    trainer: GrpoTrainerSettings = Field(description="TRL GRPO settings.")
    watch_poll_s: float = Field(2.0, ge=MIN_POLL_S, allow_inf_nan=False,
                                description="Seconds between looks for new checkpoints (at least 0.05).")
    promote_to: str | None = Field(
        None, pattern=BLOCK_REF, json_schema_extra=whole_value,
        description="Production inference deployment block (`block-type-slug/block-name`) to promote the run's "
        "last snapshot to when the eval gate accepts it (the run's inference deployment is the staging one); "
        "null (None): no promotion. docs/promotion.md.")
    promotion: PromotionSettings = Field(default_factory=lambda: PromotionSettings(),
                                         description="The eval gate of promote_to.")

    _promote_to = field_validator("promote_to", mode="before")(lambda cls, v: block_ref(v))
    gc: GcSettings = Field(default_factory=GcSettings, description="Retention across runs, the run's last task.")

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, v: BaseModel) -> BaseModel:
        return check_trainer(v, "grpo")

    @model_validator(mode="after")
    def _promotion(self) -> NightlySettings:
        if self.promote_to is not None:
            if self.inference is None:
                raise ValueError("promote_to: promotion evaluates on the run's inference deployment (staging): "
                                 "name its block in inference")
            if self.promote_to == self.inference:
                raise ValueError("promote_to: the production deployment must not be the run's inference "
                                 "deployment (staging)")
            self.promotion.require_eval_dataset("promote_to")
        return self


class GrpoSettings(RunSettings):
    """GRPO with rollouts sampled from the inference deployment, round by round."""

    rounds: int = Field(2, ge=1, description="GRPO rounds (publish, hot-load, sample, train).")
    prompts_per_round: int = Field(8, ge=1, description="Prompts sampled per round.")
    shards: int = Field(2, ge=1, description="Rollout shards per round, sampled concurrently.")
    task_runner: Literal["threads", "dask"] = Field(
        "threads", description="Where the rollout shards run: `threads` in the flow's process, or `dask` on a Dask "
        "cluster (dask_address, else a temporary local one). docs/prefect.md.")
    dask_address: str | None = Field(  # the schema's pattern also refuses a final newline (see whole_value)
        None, pattern=DASK_ADDRESS, json_schema_extra={"pattern": DASK_ADDRESS + r"(?!\n)"},
        description="With task_runner `dask`: the address of a running Dask scheduler (e.g. `tcp://10.0.0.5:8786`); "
        "null (None): a temporary local cluster, started for the run and stopped after its rounds.")
    dask_workers: int | None = Field(
        None, ge=1, description="With task_runner `dask` and no dask_address: worker processes of the temporary "
        "cluster; null (None): Dask's default (one per core or so).")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="Sampling and rewards.")
    trainer: StepTrainerSettings = Field(default_factory=StepTrainerSettings,
                                         description="Settings of the training step.")
    trainer_job: Literal["resident", "per_round"] = Field(
        "resident", description="resident: one training job for the whole run, which loads the policy and its "
        "optimizer once and trains each round as the flow hands it its rollouts. per_round: a training job per "
        "round (loads both again each round), for clusters with a short job time limit or preemptible queues, "
        "where GPUs held idle between rounds cost more than reloading. docs/trainer.md.")
    max_staleness: int = Field(
        0, ge=0, le=16, description="Asynchronous rounds: round r may be sampled from a policy up to this many "
        "versions older than the one that trains it, so rounds r+1 .. r+k are sampled while round r trains; "
        "sampling waits (drops nothing) at the bound, and the trainer never trains on older rollouts. 0: "
        "synchronous rounds, each sampled from the policy the round before trained. resident only. docs/trainer.md.")
    round_timeout_s: float = Field(
        1800.0, gt=0, description="resident: seconds the trainer waits for a round's rollouts after the flow run's "
        "last heartbeat before its job ends (the flow beats while it works on a round, however slow; a flow run "
        "that failed has this long to be retried and find its job waiting).")
    watch_poll_s: float = Field(2.0, ge=MIN_POLL_S, allow_inf_nan=False, description="resident: seconds between "
                                "looks for the trainer's checkpoints (at least 0.05).")

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, v: BaseModel) -> BaseModel:
        return check_trainer(v, "step")

    @property
    def ref_model(self) -> str | None:
        """The reference model the job loads (ref_model_name_or_path, with beta > 0), else None."""
        return self.trainer.ref_model_name_or_path if self.trainer.beta > 0 else None

    @field_validator("inference")
    @classmethod
    def _inference(cls, v: str | None) -> str | None:
        if v is None:
            raise ValueError("GRPO samples its rollouts from an inference deployment: name its block")
        return v

    @model_validator(mode="after")
    def _staleness(self) -> GrpoSettings:
        if self.max_staleness and self.trainer_job != "resident":
            raise ValueError(f"max_staleness: asynchronous rounds need trainer_job resident (trainer_job is "
                             f"{self.trainer_job}: each round's job starts from the round before's checkpoint)")
        return self

    @model_validator(mode="after")
    def _dask(self) -> GrpoSettings:
        if self.task_runner != "dask":
            for name in ("dask_address", "dask_workers"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only with task_runner dask (task_runner is {self.task_runner})")
        elif self.dask_address is not None and self.dask_workers is not None:
            raise ValueError("dask_workers: sizes the temporary cluster; the cluster at dask_address has its own "
                             "workers (give one or the other)")
        return self


def run_suffix(flow_run_id: object) -> str:
    """A flow run's short id: the first 8 hex digits of its id ("local" outside a flow run)."""
    return str(flow_run_id or "").replace("-", "")[:8] or "local"


def flow_run_name() -> str:
    """A flow run's name (the flows' ``flow_run_name``): the user-given run name, the day it was
    scheduled for and the run's short id, e.g. ``nightly-2026-11-30-0729d8b7`` for the run that works
    in ``runs/nightly-0729d8b7`` (``for_flow_run``). The id tells apart the runs of one day (in the
    artifact history, for a retry by name); a retry is the same flow run, with the same id and the
    same expected start time, so the engine names it again the same."""
    from datetime import UTC, datetime

    from prefect.runtime import flow_run

    name = (flow_run.parameters or {}).get("run_name")
    when = flow_run.scheduled_start_time or datetime.now(UTC)
    return renamed(f"{name or flow_run.flow_name}-{when:%Y-%m-%d}-{run_suffix(flow_run.id)}")


def renamed(name: str) -> str:
    """``name``, a flow run's own name, after logging it where the user looks: the engine renames the
    run when it starts, after the CLI printed its creation name (``Created flow run 'wooden-koala'``,
    or what the run form pre-filled) and says so only at debug level. The name needs the flow run's
    id, so no name given at creation can be it."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger
    from prefect.runtime import flow_run

    created = flow_run.name
    if created and created != name:  # a retry keeps its name: nothing to say
        try:
            get_run_logger().info("This flow run is named %s, not %s: a run names itself when it starts, "
                                  "with the day and its short id (docs/run-form.md#flow-run-names)", name, created)
        except MissingContextError:  # called outside a flow run (tests)
            pass
    return name

