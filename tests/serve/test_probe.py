"""The probe that travels with a snapshot: judging an engine's answers, reading the file, scoring
through a completions endpoint, and the reference engine refusing weights that do not answer it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from posttrain.chain.probe import PROBE_NAME, Probe, probe_bytes, probe_prompts, write_probe
from posttrain.serve.holding import distance
from posttrain.serve.probe import (
    completions_body,
    judge,
    parse_prompt_logprobs,
    read_probe,
    score_with_model,
    tolerance,
    versions_distance,
)

TOL = 1e-3  # float32's


def make_probe(logprobs: list[list[float]], completions: list[list[int]] | None = None,
               dtype: str = "float32") -> Probe:
    prompts = probe_prompts(100, n=len(logprobs), length=4)
    completions = completions or [[(7 * i + j) % 100 for j in range(len(row))] for i, row in enumerate(logprobs)]
    return Probe(dtype=dtype, vocab_size=100, prompts=prompts, completions=completions, logprobs=logprobs)


BASE = [[-1.0, -2.0, -0.5], [-3.0, -0.25, -1.5], [-0.75, -4.0, -2.5]]


def shifted(rows: list[list[float]], by: float, prompt: int | None = None) -> list[list[float]]:
    return [[x - by if prompt in (None, i) else x for x in row] for i, row in enumerate(rows)]


# --- tolerance ---

def test_tolerance_per_dtype():
    assert tolerance("float32") == 1e-3
    assert tolerance("torch.float32") == 1e-3
    assert tolerance("float16") == 0.02
    assert tolerance("bfloat16") == 0.1
    assert tolerance("float32") < tolerance("float16") < tolerance("bfloat16")
    with pytest.raises(ValueError, match="int8"):
        tolerance("int8")


def test_a_deep_model_in_a_coarse_dtype_is_allowed_its_layers_spread(tmp_path):
    from posttrain.serve.checks import model_depth

    # SmolLM2-135M's 30 layers: vLLM's bfloat16 kernels were 0.269 from the trainer's probe
    assert tolerance("bfloat16", layers=30) == pytest.approx(0.9)
    assert tolerance("float16", layers=30) == pytest.approx(0.12)
    assert tolerance("bfloat16", layers=2) == tolerance("bfloat16") == 0.1  # shallow: the dtype's floor
    assert tolerance("float32", layers=30) == 1e-3  # float32 kernels agree at any depth
    probe = make_probe(BASE, dtype="bfloat16")
    assert not judge(shifted(BASE, 0.269), probe, None, None).ok  # as before, without the depth
    verdict = judge(shifted(BASE, 0.269), probe, None, None, layers=30)
    assert verdict.ok and "tolerance 0.9 for bfloat16 at 30 layers" in verdict.reason
    assert not judge(shifted(BASE, 1.5), probe, None, None, layers=30).ok  # far weights are still refused
    # an engine computing float32 weights in bfloat16 gets bfloat16's deep tolerance
    assert judge(shifted(BASE, 0.269), make_probe(BASE), None, None, engine_dtype="bfloat16", layers=30).ok
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    assert model_depth(tmp_path) == 30
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 12}}))
    assert model_depth(tmp_path) == 12
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": "30"}))
    assert model_depth(tmp_path) is None and model_depth(tmp_path / "missing") is None


# --- judge ---

def test_judge_passes_answers_within_tolerance_without_a_previous_version():
    new = make_probe(BASE)
    verdict = judge(shifted(BASE, 0.9 * TOL, prompt=1), new, None, None, version="v2")
    assert verdict.ok and bool(verdict)
    assert verdict.max_difference == pytest.approx(0.9 * TOL)


def test_judge_refuses_answers_too_far_naming_prompt_difference_and_tolerance():
    new = make_probe(BASE)
    verdict = judge(shifted(BASE, 0.83, prompt=2), new, None, None, version="v2")
    assert not verdict.ok and verdict.prompt == 2
    assert verdict.reason == ("the engine's answers to probe prompt 2 differ from version v2's by 0.83 "
                              "(tolerance 0.001 for float32): it does not hold version v2's weights")
    assert "\n" not in verdict.reason
    # just past the tolerance is refused too; bf16 weights get a wider one
    assert not judge(shifted(BASE, 1.5 * TOL), new, None, None).ok
    assert judge(shifted(BASE, 0.05), make_probe(BASE, dtype="bfloat16"), None, None).ok
    # an engine computing in a coarser dtype than the weights gets that dtype's tolerance
    assert judge(shifted(BASE, 0.05), new, None, None, engine_dtype="bfloat16").ok


def test_judge_passes_when_closer_to_the_new_version_than_to_the_previous():
    new, previous = make_probe(BASE), make_probe(shifted(BASE, 0.5))
    scored = shifted(BASE, 0.1 * TOL)  # the same sequences: the engine scores both probes alike
    verdict = judge(scored, new, scored, previous, version="v2", previous_version="v1")
    assert verdict.ok, verdict.reason


def test_judge_refuses_answers_closer_to_the_previous_version():
    # the versions differ by 1.5x the tolerance; the engine is within tolerance of both, nearer the old one
    new, previous = make_probe(BASE), make_probe(shifted(BASE, 1.5 * TOL))
    scored = shifted(BASE, 0.9 * TOL)
    assert judge(scored, new, None, None).ok  # alone, within tolerance of the new version
    verdict = judge(scored, new, scored, previous, version="v2", previous_version="v1")
    assert not verdict.ok
    assert "probe prompt" in verdict.reason and "than from version v1's" in verdict.reason
    assert "tolerance 0.001 for float32" in verdict.reason and "still holds version v1's weights" in verdict.reason


def test_judge_ignores_the_previous_version_when_the_two_are_indistinguishable():
    new, previous = make_probe(BASE), make_probe(shifted(BASE, 0.5 * TOL))
    assert versions_distance(new, previous) == pytest.approx(0.5 * TOL)
    scored = shifted(BASE, 0.4 * TOL)  # nearer the previous version, but the two are within tolerance
    assert judge(scored, new, scored, previous).ok


def test_versions_distance_compares_only_the_shared_greedy_prefix():
    completions = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    other = [[1, 2, 99], [40, 5, 6], [7, 8, 9]]  # prompt 0 parts at token 2, prompt 1 at token 0
    new = make_probe(BASE, completions)
    previous = make_probe([[-1.0 - 0.002, -2.0, -9.0], [-9.0, -9.0, -9.0], BASE[2]], other)
    assert versions_distance(new, previous) == pytest.approx(0.002)


@pytest.mark.parametrize("bad,shown", [(math.nan, "NaN"), (-math.inf, "-infinity"), (math.inf, "infinity")])
def test_judge_refuses_nan_and_infinities_wherever_a_distance_is_compared(bad, shown):
    new, previous = make_probe(BASE), make_probe(shifted(BASE, 0.5))
    # a NaN difference compares below every tolerance: scores holding one were judged within it
    scored = [row[:] for row in BASE]
    scored[1][2] = bad
    verdict = judge(scored, new, None, None, version="v2")
    assert not verdict.ok and verdict.prompt == 1 and verdict.max_difference == math.inf
    assert verdict.reason == (f"the engine's answer to probe prompt 1 is {shown} (tolerance 0.001 for float32): "
                              "it does not hold version v2's weights")
    # the expected answers (a Probe refuses them on read; one built around its checks is refused here too)
    broken = Probe.model_construct(**{**new.model_dump(), "logprobs": scored})
    verdict = judge(BASE, broken, None, None, version="v2")
    assert not verdict.ok and f"version v2's expected answer to probe prompt 1 is {shown}" in verdict.reason
    # the previous version's side of the comparison
    verdict = judge(BASE, new, scored, previous, version="v2")
    assert not verdict.ok and f"(scoring the previous version's probe) to probe prompt 1 is {shown}" in verdict.reason
    broken_previous = Probe.model_construct(**{**previous.model_dump(), "logprobs": scored})
    assert versions_distance(new, broken_previous) == math.inf
    assert not judge(BASE, new, BASE, broken_previous).ok
    # the gateway's fingerprints of a replica: NaN on either side is infinitely far
    assert distance([-1.0, bad], [-1.0, -2.0]) == distance([-1.0, -2.0], [-1.0, bad]) == math.inf
    assert distance([-1.0, -2.0], [-1.0, -2.0 + 1e-6]) == pytest.approx(1e-6)


def test_judge_checks_the_shape_of_the_scores():
    with pytest.raises(ValueError, match="2 scored sequences for a probe of 3 prompts"):
        judge(BASE[:2], make_probe(BASE), None, None)
    with pytest.raises(ValueError, match="probe prompt 1 has 3 completion tokens, 2 were scored"):
        judge([BASE[0], BASE[1][:2], BASE[2]], make_probe(BASE), None, None)


# --- the file ---

def test_read_probe_round_trip_and_absent(tmp_path):
    assert read_probe(tmp_path) is None
    probe = make_probe(BASE)
    write_probe(tmp_path, probe)
    assert read_probe(tmp_path) == probe
    assert (tmp_path / PROBE_NAME).read_bytes() == probe_bytes(probe)
    assert json.loads((tmp_path / PROBE_NAME).read_text())["format"] == "posttrain-probe-v1"
    assert probe.sequences()[1] == (probe.prompts[1] + probe.completions[1], 4)
    with pytest.raises(ValidationError):
        probe.dtype = "float16"  # frozen


@pytest.mark.parametrize("content,why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (None, "note: Extra inputs"),  # an unknown key
    ("completions", "3 completion tokens but 2 logprobs"),
    ("vocab", "outside the vocabulary"),
    ("dtype", "dtype"),
    ("format", "format"),
])
def test_read_probe_names_the_file_and_what_is_wrong(tmp_path, content, why):
    obj = json.loads(probe_bytes(make_probe(BASE)))
    if content is None:
        obj["note"] = "x"
    elif content == "completions":
        obj["logprobs"][1] = obj["logprobs"][1][:2]
    elif content == "vocab":
        obj["completions"][0][0] = 100
    elif content == "dtype":
        obj["dtype"] = "int8"
    elif content == "format":
        obj["format"] = "posttrain-probe-v9"
    raw = content if isinstance(content, bytes) else json.dumps(obj).encode()
    (tmp_path / PROBE_NAME).write_bytes(raw)
    with pytest.raises(ValueError, match=why) as e:
        read_probe(tmp_path)
    assert str(tmp_path / PROBE_NAME) in str(e.value)


def test_probe_prompts_are_fixed_and_inside_any_vocabulary():
    assert probe_prompts(512) == probe_prompts(512)
    for vocab in (2, 3, 512, 151936):
        prompts = probe_prompts(vocab)
        assert len(prompts) == 4 and all(len(p) == 8 for p in prompts)
        assert all(0 <= t < vocab for p in prompts for t in p)
    assert len({tuple(p) for p in probe_prompts(512)}) == 4


# --- scoring through a completions endpoint (vLLM's prompt_logprobs) ---

def test_completions_body_scores_the_sequence():
    probe = make_probe(BASE)
    ids, start = probe.sequences()[0]
    body = completions_body("tiny", probe.sequences()[0])
    assert body == {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                    "prompt_logprobs": 1}
    assert completions_body("tiny", ids) == body


def vllm_reply(ids: list[int], logprobs: list[float], top: int = 3) -> dict:
    """What vLLM answers: None first, then the prompt token's entry plus the top-1 token's when it differs."""
    positions: list = [None]
    for t, lp in zip(ids[1:], logprobs[1:], strict=True):
        entry = {str(t): {"logprob": lp, "rank": 2 if t != top else 1, "decoded_token": "x"}}
        if t != top:
            entry[str(top)] = {"logprob": -0.01, "rank": 1, "decoded_token": "y"}
        positions.append(entry)
    return {"choices": [{"text": "", "prompt_logprobs": positions}]}


def test_parse_prompt_logprobs_takes_the_sequences_own_token():
    ids = [5, 3, 7, 9, 3]
    lps = [0.0, -0.5, -1.25, -2.0, -0.01]
    reply = vllm_reply(ids, lps)
    assert parse_prompt_logprobs(reply, 2, ids) == [-1.25, -2.0, -0.01]
    assert parse_prompt_logprobs(reply, 2) == [-1.25, -2.0, -0.01]  # by rank, without the ids
    reply["choices"][0]["prompt_token_ids"] = ids
    assert parse_prompt_logprobs(reply, 1) == [-0.5, -1.25, -2.0, -0.01]
    numbers = {"choices": [{"prompt_logprobs": [None, {"3": -0.5}, {"7": -1.25, "3": -0.1}]}]}
    assert parse_prompt_logprobs(numbers, 1, [5, 3, 7]) == [-0.5, -1.25]
    with pytest.raises(ValueError, match="no way to tell"):
        parse_prompt_logprobs(numbers, 1)
    with pytest.raises(ValueError, match="no entry for the prompt's token 8"):
        parse_prompt_logprobs(numbers, 1, [5, 3, 8])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        parse_prompt_logprobs({"choices": [{"text": ""}]}, 1)


# --- in process: the reference engine ---

def _perturbed_copy(src: Path, dst: Path, seed: int) -> Path:
    from tests.support.serving import _perturb

    _perturb(src, dst, seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    return dst


def _with_probe(folder: Path) -> Probe:
    from transformers import AutoModelForCausalLM

    from posttrain.trainer.probe import write_checkpoint_probe

    probe = write_checkpoint_probe(AutoModelForCausalLM.from_pretrained(folder).eval(), folder)
    assert probe is not None
    return probe


@pytest.fixture(scope="module")
def versions(tiny_model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("probe-versions")
    m0 = root / "m0"
    shutil.copytree(tiny_model_dir, m0)
    m1 = _perturbed_copy(m0, root / "m1", 1)
    m2 = _perturbed_copy(m1, root / "m2", 2)
    for m in (m0, m1, m2):
        _with_probe(m)
    return [m0, m1, m2]


def test_score_with_model_reproduces_the_trainers_answers(versions):
    from transformers import AutoModelForCausalLM

    probe = read_probe(versions[1])
    model = AutoModelForCausalLM.from_pretrained(versions[1]).eval()
    assert judge(score_with_model(model, probe.sequences()), probe, None, None).max_difference == 0.0
    other = AutoModelForCausalLM.from_pretrained(versions[2]).eval()
    assert not judge(score_with_model(other, probe.sequences()), probe, None, None).ok


def _engine(boot: Path, tmp_path: Path):
    from pydantic import SecretStr

    from posttrain.serve.reference import ReferenceEngine
    from posttrain.serve.serve_config import ServeConfig

    return ReferenceEngine(ServeConfig(model_dir=boot, deployment_id="d", store=str(tmp_path), token=SecretStr("t"),
                                       work_dir=tmp_path / "work", port=0, device="cpu"))


def test_reference_engine_refuses_weights_that_do_not_answer_their_probe(versions, tmp_path):
    m0, m1, m2 = versions
    engine = _engine(m0, tmp_path)
    assert engine.load(m1, "v1").identity == "v1"  # its own probe: served
    # m2's weights with m1's probe (computed on other weights): refused, v1 keeps serving
    bad = tmp_path / "m2-with-m1-probe"
    shutil.copytree(m2, bad)
    shutil.copy2(m1 / PROBE_NAME, bad / PROBE_NAME)
    with pytest.raises(ValueError, match=r"probe prompt \d differ from version v2's by .* \(tolerance 0.001 for "
                                         r"float32\): it does not hold version v2's weights"):
        engine.load(bad, "v2")
    assert engine.current().identity == "v1" and engine.current().path == m1
    # m1's weights again under m2's probe: the stale version is refused too
    stale = tmp_path / "m1-with-m2-probe"
    shutil.copytree(m1, stale)
    shutil.copy2(m2 / PROBE_NAME, stale / PROBE_NAME)
    with pytest.raises(ValueError, match="it does not hold version v2's weights"):
        engine.load(stale, "v2")
    assert engine.current().identity == "v1"
    assert engine.load(m2, "v2").identity == "v2"


def test_reference_engine_loads_folders_without_a_probe_as_before(versions, tmp_path):
    m0, m1, _ = versions
    plain = tmp_path / "m1-plain"
    shutil.copytree(m1, plain)
    (plain / PROBE_NAME).unlink()
    engine = _engine(m0, tmp_path)
    assert engine.load(plain, "v1").identity == "v1"
    broken = tmp_path / "m1-broken-probe"
    shutil.copytree(m1, broken)
    (broken / PROBE_NAME).write_text("{")
    with pytest.raises(ValueError, match=f"{PROBE_NAME}: not a probe file"):
        engine.load(broken, "v1b")
    assert engine.current().identity == "v1"
