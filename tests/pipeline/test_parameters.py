"""The flows' flat parameters: one typed top-level parameter per setting, checked by the schema
Prefect enforces when a run is created, and turned back into the typed settings with errors that
name the parameter."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import jsonschema
import pytest

from posttrain.pipeline.parameters import ParameterError, from_parameters, parameter_fields, to_parameters
from posttrain.pipeline.settings import GrpoSettings, NightlySettings

BASE = dict(run_name="nightly", base_model="/m", dataset="/d.jsonl", shared_dir="/shared")
NIGHTLY = {**BASE, "reward_funcs": ["posttrain.rewards:format_reward"], "max_steps": 2}


def schema(flow) -> dict:
    return flow.parameters.model_dump()


def test_every_setting_is_a_top_level_parameter_and_round_trips():
    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.flows.nightly import nightly_post_training

    nightly = from_parameters(NightlySettings, {**NIGHTLY, "learning_rate": 5e-5, "max_deltas": 3})
    assert nightly.trainer.learning_rate == 5e-5 and nightly.publish.max_deltas == 3
    assert nightly.trainer.save_steps == 100  # not given: the trainer's default
    assert from_parameters(NightlySettings, to_parameters(nightly)) == nightly
    assert set(schema(nightly_post_training)["properties"]) == set(parameter_fields(NightlySettings))
    assert set(schema(grpo)["properties"]) == set(parameter_fields(GrpoSettings))
    # GRPO: the rollouts' sampling settings; the step trainer has no sampling fields of its own.
    assert {"num_generations", "temperature", "reward_funcs", "importance_sampling_cap"} <= set(
        schema(grpo)["properties"])
    assert "max_steps" not in schema(grpo)["properties"]


@pytest.mark.parametrize(("bad", "names"), [
    ({"learning_rate": -1}, "learning_rate"),
    ({"max_steps": 0}, "max_steps"),
    ({"reward_funcs": ["nope"]}, "'module:function'"),
    ({"base_model": "relative/model"}, "base_model"),
    ({"max_deltas": 100000}, "max_deltas"),
    ({"lr": 1}, "unknown parameters: lr"),
    ({"per_device_train_batch_size": 3, "num_generations": 2}, "multiple of num_generations"),
])
def test_bad_parameters_are_named_without_their_group(bad, names):
    with pytest.raises(ParameterError) as e:
        from_parameters(NightlySettings, {**NIGHTLY, **bad})
    assert names in str(e.value)
    assert "trainer." not in str(e.value) and "publish." not in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("bad", "where"), [
    ({"max_steps": -5}, "minimum"),
    ({"learning_rate": 0}, "exclusiveMinimum"),
    ({"base_model": "models/tiny"}, "pattern"),
    ({"shared_dir": "shared"}, "pattern"),
    ({"reward_funcs": ["posttrain.rewards"]}, "pattern"),
    ({"reward_funcs": []}, "minItems"),
    ({"run_name": "Nightly"}, "pattern"),
    ({"run_name": "x" * 37}, "pattern"),
    ({"store": "nope"}, "pattern"),
    ({"lr": 1e-5}, "additionalProperties"),
    # a final newline: Prefect's jsonschema checks patterns with re.search, where "$" matches before one
    ({"run_name": "nightly\n"}, "pattern"),
    ({"cluster": "posttrain-local-cluster/default\n"}, "pattern"),
    ({"store": "posttrain-object-store/default\n"}, "pattern"),
    ({"inference": "posttrain-inference-deployment/default\n"}, "pattern"),
    ({"reward_funcs": ["posttrain.rewards:format_reward\n"]}, "pattern"),
])
def test_the_schema_refuses_what_the_settings_refuse(bad, where):
    """What a deployment with enforce_parameter_schema checks when the run is created (Prefect
    validates against this schema with jsonschema, additionalProperties off)."""
    from posttrain.pipeline.flows.nightly import nightly_post_training

    s = schema(nightly_post_training)
    s["additionalProperties"] = False
    jsonschema.validate({**NIGHTLY}, s)  # the good parameters pass
    with pytest.raises(jsonschema.ValidationError) as e:
        jsonschema.validate({**NIGHTLY, **bad}, s)
    assert e.value.validator == where
    with pytest.raises((ParameterError, ValueError)):
        from_parameters(NightlySettings, {**NIGHTLY, **bad})


def test_the_run_name_pattern_survives_rich_markup():
    """Prefect's CLI prints a refused pattern through rich: no bracket may start with a letter."""
    from rich.text import Text

    from posttrain.pipeline.settings import BLOCK_REF, RUN_NAME_RE

    for pattern in (RUN_NAME_RE.pattern, BLOCK_REF):
        assert Text.from_markup(pattern).plain == pattern


def _patterns(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "pattern" and isinstance(v, str)] + _patterns(list(node.values()))
    return [p for v in node for p in _patterns(v)] if isinstance(node, list) else []


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node: the UI's form checks patterns in JavaScript")
def test_the_schema_patterns_refuse_a_final_newline_and_compile_in_javascript():
    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.flows.nightly import nightly_post_training

    patterns = sorted({p for flow in (nightly_post_training, grpo) for p in _patterns(schema(flow))})
    assert any("(?!\\n)" in p for p in patterns)  # the capture worked: the patterns with the lookahead are here
    script = ("const ps = JSON.parse(require('fs').readFileSync(0, 'utf8')); let n = 0;"
              "for (const p of ps) for (const flags of ['', 'u']) { new RegExp(p, flags); n++; }"
              "console.log(n);")  # new RegExp throws on a pattern JavaScript cannot compile
    out = subprocess.run(["node", "-e", script], input=json.dumps(patterns), capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, str(2 * len(patterns))), out.stderr


def test_grpo_step_samples_at_the_rollouts_temperature():
    settings = from_parameters(GrpoSettings, {**BASE, "temperature": 0.7})
    assert settings.rollout.temperature == 0.7
    assert "temperature" not in type(settings.trainer).model_fields


def test_a_picked_block_is_named_like_a_given_one():
    """The UI's picker sends Prefect's reference to a saved block; a run's stored parameters keep it."""
    picked = {"$ref": {"block_document_slug": "posttrain-object-store/nightly"}}
    assert from_parameters(NightlySettings, {**NIGHTLY, "store": picked}).store == "posttrain-object-store/nightly"


def test_lora_group_is_flat_and_reaches_the_trainer():
    from posttrain.pipeline.flows.nightly import nightly_post_training
    from posttrain.pipeline.settings import trainer_config

    lora_params = {"use_lora", "r", "lora_alpha", "lora_dropout", "target_modules", "lora_publish"}
    assert lora_params <= set(schema(nightly_post_training)["properties"])
    assert lora_params <= set(parameter_fields(GrpoSettings))
    assert "lora" not in parameter_fields(NightlySettings)  # the trainer's section comes from the group
    plain = from_parameters(NightlySettings, NIGHTLY)
    assert trainer_config(plain.trainer, plain.lora, mode="grpo", model_name_or_path="/m", output_dir="/o",
                          dataset_manifest="/d.json").lora is None
    on = from_parameters(NightlySettings, {**NIGHTLY, "use_lora": True, "r": 8, "target_modules": ["q_proj"]})
    assert from_parameters(NightlySettings, to_parameters(on)) == on
    lora = trainer_config(on.trainer, on.lora, mode="grpo", model_name_or_path="/m", output_dir="/o",
                          dataset_manifest="/d.json").lora
    assert (lora.r, lora.lora_alpha, lora.target_modules) == (8, 32, ["q_proj"])
    assert from_parameters(NightlySettings, {**NIGHTLY, "use_lora": True, "lora_publish": "adapter"}).lora.lora_publish \
        == "adapter"
    with pytest.raises(ParameterError, match="^lora_publish: "):
        from_parameters(NightlySettings, {**NIGHTLY, "use_lora": True, "lora_publish": "both"})
    with pytest.raises(ParameterError, match="^r: "):
        from_parameters(NightlySettings, {**NIGHTLY, "r": 0})


def test_trackers_are_parameters_of_both_flows_and_the_run_name_is_their_default():
    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.flows.nightly import nightly_post_training
    from posttrain.pipeline.settings import trainer_config

    for flow in (nightly_post_training, grpo):
        properties = schema(flow)["properties"]
        assert {"report_to", "tracker_run_name"} <= set(properties), flow.name
        assert "logging_dir" not in properties  # the flows put it in the run folder
        assert properties["report_to"]["default"] == ["tensorboard"]
    filled = dict(mode="grpo", model_name_or_path="/m", output_dir="/shared/runs/n-1/output",
                  dataset_manifest="/d.json", logging_dir="/shared/runs/n-1/tensorboard")
    plain = from_parameters(NightlySettings, NIGHTLY)
    config = trainer_config(plain.trainer, plain.lora, run_name="n-1", **filled)
    assert (config.report_to, config.run_name) == (["tensorboard"], "n-1")
    assert str(config.tensorboard_dir) == "/shared/runs/n-1/tensorboard"
    named = from_parameters(NightlySettings, {**NIGHTLY, "report_to": ["tensorboard", "wandb"],
                                              "tracker_run_name": "night-of-the-21st"})
    assert from_parameters(NightlySettings, to_parameters(named)) == named
    config = trainer_config(named.trainer, named.lora, run_name="n-1", **filled)
    assert (config.report_to, config.run_name) == (["tensorboard", "wandb"], "night-of-the-21st")
    step = from_parameters(GrpoSettings, {**BASE, "report_to": ["none"]})
    assert trainer_config(step.trainer, step.lora, run_name="g-1", mode="step", model_name_or_path="/m",
                          output_dir="/o", rollouts="/r.jsonl").trackers == []
    with pytest.raises(ParameterError, match="^report_to: .*none"):
        from_parameters(NightlySettings, {**NIGHTLY, "report_to": ["none", "tensorboard"]})
    with pytest.raises(ParameterError, match="^report_to: "):
        from_parameters(NightlySettings, {**NIGHTLY, "report_to": ["Weights & Biases"]})


def test_block_parameters_open_the_run_form_on_their_name():
    """The UI's run form shows a tab per ``anyOf`` member and opens the first whose JSON ``type`` is
    the value's: a block's name (a string) is a flat string member, first and titled; a nested
    ``anyOf`` (``str | None``) has no type, and the form showed an empty block picker instead."""
    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.flows.nightly import nightly_post_training
    from posttrain.pipeline.settings import BLOCK_PARAMETERS

    for flow in (nightly_post_training, grpo):
        properties = schema(flow)["properties"]
        for name, blocks in BLOCK_PARAMETERS.items():
            members = properties[name]["anyOf"]
            assert all("anyOf" not in m for m in members), members
            assert (members[0]["type"], members[0]["title"]) == ("string", "by name")
            assert [m["$ref"].rsplit("/", 1)[1] for m in members[1:1 + len(blocks)]] == [b.__name__ for b in blocks]
        assert properties["inference"]["anyOf"][-1] == {"type": "null"}  # none, on a tab of its own


def test_descriptions_render_as_markdown_without_html():
    """The run form renders each description as markdown, where "<name>" is an HTML tag and vanishes
    (what it shows: tests/pipeline/test_ui_form.py)."""
    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.flows.nightly import nightly_post_training

    for flow in (nightly_post_training, grpo):
        described = {k: p["description"] for k, p in schema(flow)["properties"].items()}
        assert not {k: d for k, d in described.items() if re.search(r"<[A-Za-z/!?]", d)}


@pytest.mark.parametrize("value", [1e-300, 0.01, 0, float("nan"), float("inf")])
@pytest.mark.parametrize(("model", "given"), [(NightlySettings, NIGHTLY), (GrpoSettings, BASE)],
                         ids=["nightly", "grpo"])
def test_a_busy_poll_is_refused_naming_watch_poll_s(model, given, value):
    """1e-300 passed ``> 0`` and the checkpoint watch then polled without pause (a busy loop)."""
    with pytest.raises(ParameterError, match=r"^watch_poll_s: ") as e:
        from_parameters(model, {**given, "watch_poll_s": value})
    assert "\n" not in str(e.value)
    assert from_parameters(model, {**given, "watch_poll_s": 0.05}).watch_poll_s == 0.05


def test_the_schema_refuses_a_busy_poll():
    from posttrain.pipeline.flows.nightly import nightly_post_training

    s = schema(nightly_post_training)
    with pytest.raises(jsonschema.ValidationError) as e:
        jsonschema.validate({**NIGHTLY, "watch_poll_s": 1e-300}, s)
    assert e.value.validator == "minimum"
