"""Parameters of promotion: the eval gate (a group of the nightly and promote flows), and the promote
and rollback flows' settings (docs/promotion.md)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from posttrain.errors import describe_validation_error
from posttrain.pipeline.refs import ABSOLUTE, BLOCK_REF, block_ref, whole_value
from posttrain.promote.decision import GateConfig
from posttrain.promote.evaluate import EvalSettings
from posttrain.rollouts.scoring import REWARD_FUNCS_SCHEMA


def _prefixed(prefix: str, model: type[BaseModel], skip: frozenset[str] = frozenset()) -> dict:
    """``model``'s fields as ``<prefix><name>``: flat parameters that say which part of promotion they set."""
    return {prefix + name: (field.annotation, copy.copy(field)) for name, field in model.model_fields.items()
            if name not in skip}


def _reward_funcs_field() -> tuple:
    return (list[str] | None, Field(None, description="Reward functions of the eval by import path "
                                    "(module:function); null (None): the run's own.",
                                    json_schema_extra=REWARD_FUNCS_SCHEMA))


_PromotionFields = create_model(
    "_PromotionFields", __config__=ConfigDict(extra="forbid"),
    eval_dataset=(str | None, Field(None, description="Absolute path of the held-out eval prompts (JSONL or "
                                    "Parquet, conversational, as the training dataset); staged like it.",
                                    json_schema_extra=ABSOLUTE)),
    **{**_prefixed("eval_", EvalSettings, frozenset({"reward_funcs", "samples_per_prompt"})),
       "eval_reward_funcs": _reward_funcs_field()},
    **_prefixed("gate_", GateConfig, frozenset({"samples_per_prompt"})),
)


class PromotionSettings(_PromotionFields):
    """The eval gate: what the candidate and the champion are evaluated on and the decision rule
    (``posttrain.promote``, docs/promotion.md). ``eval_samples_per_prompt`` is the gate's n."""

    eval_samples_per_prompt: int = Field(4, ge=1, le=64, description="Completions sampled per eval prompt, on "
                                         "each side of the gate.")

    @field_validator("eval_dataset")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_absolute():
            raise ValueError(f"{v!r} is not an absolute path")
        return v

    @model_validator(mode="after")
    def _gate(self) -> PromotionSettings:
        try:
            self.gate()
        except ValidationError as e:  # name the flow's parameters (gate_margin), not GateConfig's fields
            names = re.compile(r"\b(" + "|".join(GateConfig.model_fields) + r")\b")
            raise ValueError("; ".join(names.sub(r"gate_\1", ".".join(str(p) for p in err["loc"]) + ": " if err["loc"]
                                                 else "") + names.sub(r"gate_\1", err["msg"].removeprefix("Value error, "))
                                       for err in e.errors())) from None
        if self.eval_max_prompts is not None and self.eval_max_prompts < self.gate_min_prompts:
            raise ValueError(f"eval_max_prompts: {self.eval_max_prompts} prompts can never reach gate_min_prompts "
                             f"{self.gate_min_prompts}")
        return self

    def gate(self) -> GateConfig:
        values = {name[len("gate_"):]: getattr(self, name) for name in type(self).model_fields if name.startswith("gate_")}
        return GateConfig(**values, samples_per_prompt=self.eval_samples_per_prompt)

    def eval_settings(self, default_reward_funcs: list[str] | None = None) -> EvalSettings:
        """The eval's settings; the reward functions are ``eval_reward_funcs``, else ``default_reward_funcs``."""
        funcs = self.eval_reward_funcs or default_reward_funcs
        if not funcs:
            raise ValueError("eval_reward_funcs: name the eval's reward functions (module:function)")
        values = {name[len("eval_"):]: getattr(self, name) for name in type(self).model_fields
                  if name.startswith("eval_") and name not in ("eval_dataset", "eval_reward_funcs")}
        try:
            return EvalSettings(**values, reward_funcs=funcs)
        except ValidationError as e:
            raise ValueError(describe_validation_error(e, {k[len("eval_"):]: k for k in type(self).model_fields
                                                           if k.startswith("eval_")})) from None

    def require_eval_dataset(self, why: str) -> None:
        if self.eval_dataset is None:
            raise ValueError(f"eval_dataset: {why} needs the held-out eval prompts the gate evaluates on")


class PromoteSettings(BaseModel):
    """The promote flow: evaluate a candidate against production's champion on the staging
    deployment and promote it when the gate accepts (docs/promotion.md)."""

    model_config = ConfigDict(extra="forbid")

    production: str = Field(pattern=BLOCK_REF, json_schema_extra=whole_value,
                            description="Production inference deployment block (`block-type-slug/block-name`).")
    staging: str = Field("posttrain-inference-deployment/default", pattern=BLOCK_REF, json_schema_extra=whole_value,
                         description="Staging inference deployment block, where both sides are evaluated.")
    store: str = Field("posttrain-object-store/default", pattern=BLOCK_REF, json_schema_extra=whole_value,
                       description="Object store block of the chain (and of the promotion history).")
    candidate: str | None = Field(None, description="Snapshot identity to promote; null (None): the last snapshot "
                                  "candidate_run published.")
    candidate_run: str | None = Field(None, description="Run whose last published snapshot is the candidate (its "
                                      "name with the flow run's suffix, e.g. `nightly-0729d8b7`).")
    tokenizer: str = Field(description="Absolute path of a model folder whose tokenizer the eval uses (the base "
                           "model).", json_schema_extra=ABSOLUTE)
    shared_dir: str = Field(description="Absolute folder where the eval set is staged.", json_schema_extra=ABSOLUTE)
    promotion: PromotionSettings = Field(default_factory=lambda: PromotionSettings(),
                                         description="The eval gate.")

    _blocks = field_validator("production", "staging", "store", mode="before")(lambda cls, v: block_ref(v))

    @field_validator("tokenizer", "shared_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not Path(v).is_absolute():
            raise ValueError(f"{v!r} is not an absolute path")
        return v

    @model_validator(mode="after")
    def _one_candidate(self) -> PromoteSettings:
        if (self.candidate is None) == (self.candidate_run is None):
            raise ValueError("candidate, candidate_run: give the snapshot identity to promote or the run whose last "
                             "snapshot to promote (exactly one)")
        if self.production == self.staging:
            raise ValueError("production: must not be the staging deployment")
        self.promotion.require_eval_dataset("promotion")
        return self


class RollbackSettings(BaseModel):
    """The rollback flow: production serves an earlier version again (docs/promotion.md)."""

    model_config = ConfigDict(extra="forbid")

    production: str = Field(pattern=BLOCK_REF, json_schema_extra=whole_value,
                            description="Production inference deployment block (`block-type-slug/block-name`).")
    store: str = Field("posttrain-object-store/default", pattern=BLOCK_REF, json_schema_extra=whole_value,
                       description="Object store block of the chain (and of the promotion history).")
    to: str = Field("previous", description="`previous` (the champion before the current one in the history), or "
                    "the identity of any snapshot in the store.")
    reason: str | None = Field(None, description="Why, recorded in the history (one line).")

    _blocks = field_validator("production", "store", mode="before")(lambda cls, v: block_ref(v))

    @field_validator("reason")
    @classmethod
    def _reason(cls, v: str | None) -> str | None:  # checked with the others, before production is touched
        if v is not None and not v.split():
            raise ValueError("is empty: give one line saying why, or leave it out for the default")
        return None if v is None else " ".join(v.split())
