"""The promote, rollback and nightly flows' promotion parameters: flat, typed, and bad values are one
line naming the parameter, before anything runs."""

from __future__ import annotations

import pytest

from posttrain.pipeline.parameters import ParameterError, from_parameters, parameter_fields
from posttrain.pipeline.promotion_settings import PromoteSettings, RollbackSettings
from posttrain.pipeline.settings import NightlySettings

PROD = "posttrain-inference-deployment/production"
PROMOTE = {"production": PROD, "candidate": "step-00000002-abc", "tokenizer": "/models/base",
           "shared_dir": "/shared", "eval_dataset": "/shared/eval.jsonl"}
NIGHTLY = {"run_name": "nightly", "base_model": "/m", "dataset": "/d.jsonl", "shared_dir": "/s",
           "reward_funcs": ["posttrain.rewards:correctness_reward"], "max_steps": 2}


def test_the_gate_and_eval_settings_are_flat_parameters_of_promote_and_nightly():
    for model in (PromoteSettings, NightlySettings):
        names = set(parameter_fields(model))
        assert {"gate_rule", "gate_margin", "gate_confidence", "gate_min_prompts", "eval_dataset",
                "eval_samples_per_prompt", "eval_reward_funcs", "eval_seed"} <= names
    settings = from_parameters(PromoteSettings, {**PROMOTE, "gate_margin": 0.05, "gate_rule": "non-inferiority",
                                                 "eval_samples_per_prompt": 3})
    gate = settings.promotion.gate()
    assert (gate.margin, gate.rule, gate.samples_per_prompt) == (0.05, "non-inferiority", 3)
    evals = settings.promotion.eval_settings(["posttrain.rewards:format_reward"])
    assert evals.reward_funcs == ["posttrain.rewards:format_reward"] and evals.samples_per_prompt == 3


@pytest.mark.parametrize(("model", "given", "message"), [
    (PromoteSettings, {"gate_margin": 2}, "gate_margin: Input should be less than or equal to 1"),
    (PromoteSettings, {"gate_margin": -0.1}, "gate_margin: Input should be greater than or equal to 0"),
    (PromoteSettings, {"gate_min_prompts": 0}, "gate_min_prompts: Input should be greater than or equal to 2"),
    (PromoteSettings, {"eval_max_prompts": 0}, "eval_max_prompts: Input should be greater than or equal to 1"),
    (PromoteSettings, {"eval_max_prompts": 4}, "eval_max_prompts: 4 prompts can never reach gate_min_prompts 8"),
    (PromoteSettings, {"gate_confidence": 0.9995}, "gate_confidence 0.9995 with gate_bootstrap_samples 10000"),
    (PromoteSettings, {"gate_min_prompts": 5}, "gate_min_prompts 5 is too few for gate_confidence 0.95"),
    (PromoteSettings, {"gate_confidence": float("nan")}, "gate_confidence: Input should be a finite number"),
    (PromoteSettings, {"eval_temperature": float("inf")}, "eval_temperature: Input should be a finite number"),
    (PromoteSettings, {"eval_reward_weights": [float("nan")], "eval_reward_funcs": ["posttrain.rewards:format_reward"]},
     "eval_reward_weights"),
    (PromoteSettings, {"eval_dataset": None}, "eval_dataset: promotion needs the held-out eval prompts"),
    (PromoteSettings, {"eval_dataset": "eval.jsonl"}, "eval_dataset: 'eval.jsonl' is not an absolute path"),
    (PromoteSettings, {"candidate_run": "nightly-1"}, "candidate, candidate_run: give the snapshot identity"),
    (PromoteSettings, {"staging": PROD}, "production: must not be the staging deployment"),
    (NightlySettings, {"promote_to": PROD}, "eval_dataset: promote_to needs the held-out eval prompts"),
    (NightlySettings, {"promote_to": "posttrain-inference-deployment/default", "eval_dataset": "/e.jsonl"},
     "promote_to: the production deployment must not be the run's inference deployment"),
    (NightlySettings, {"promote_to": PROD, "eval_dataset": "/e.jsonl", "inference": None},
     "promote_to: promotion evaluates on the run's inference deployment"),
])
def test_bad_promotion_parameters_are_one_line_naming_the_parameter(model, given, message):
    base = PROMOTE if model is PromoteSettings else NIGHTLY
    with pytest.raises(ParameterError) as e:
        from_parameters(model, {**base, **given})
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rollback_parameters():
    assert from_parameters(RollbackSettings, {"production": PROD}).to == "previous"
    with pytest.raises(ParameterError, match="production"):
        from_parameters(RollbackSettings, {"production": "not a block"})
