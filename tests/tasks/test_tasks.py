"""Tasks with verifiable rewards: seeded rows, disjoint train and eval splits, the rewards' values."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from posttrain.datasets.staging import read_staged_rows, stage_dataset
from posttrain.rollouts.scoring import load_reward_funcs, score
from posttrain.tasks import EVAL_PERCENT, TASKS, get_task, split_of
from posttrain.tasks.arithmetic import accuracy, arithmetic_correct, arithmetic_format, extract_answer, solve
from posttrain.tasks.instruct import constraint_met, length_constraint, word_count

NAMES = sorted(TASKS)


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def problems(rows: list[dict]) -> set[str]:
    return {r["problem"] for r in rows}


# --- the registry -------------------------------------------------------------------------------


def test_the_registry_names_its_tasks():
    assert NAMES == ["arithmetic", "length"]
    for name, task in TASKS.items():
        assert task.name == name and task.description
        assert len(task.reward_funcs) == len(task.reward_weights) >= 1
        assert get_task(name) is task


@pytest.mark.parametrize("name", ["nope", "", None, "Arithmetic"])
def test_an_unknown_task_is_a_value_error_listing_the_known_ones(name):
    with pytest.raises(ValueError, match=r"unknown task .*; known tasks: arithmetic, length$"):
        get_task(name)


def test_a_task_is_frozen():
    with pytest.raises(AttributeError):
        get_task("arithmetic").name = "other"


def test_the_package_does_not_import_torch():
    code = "import sys, posttrain.tasks; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- rows: seeded, well formed, stageable --------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_the_same_seed_gives_the_same_rows(name):
    task = get_task(name)
    for split in ("train", "eval"):
        assert task.rows(split, 40, seed=3) == task.rows(split, 40, seed=3)
        assert task.rows(split, 40, seed=3) != task.rows(split, 40, seed=4)
    assert task.rows("train", 40, seed=3) != task.rows("eval", 40, seed=3)


def test_the_rows_do_not_depend_on_the_process():
    """String-seeded RNG and SHA-256 splits: the same rows in a fresh interpreter (another hash seed)."""
    code = ("import json; from posttrain.tasks import TASKS; "
            "print(json.dumps({n: t.rows(s, 12, 5) for n, t in TASKS.items() for s in ('train', 'eval')}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    here = {n: t.rows(s, 12, 5) for n, t in TASKS.items() for s in ("train", "eval")}
    assert json.loads(out) == json.loads(json.dumps(here))


@pytest.mark.parametrize("name", NAMES)
def test_rows_are_conversational_with_a_reference_answer(name):
    rows = get_task(name).rows("train", 30, seed=0)
    assert len(rows) == 30
    for row in rows:
        assert set(row) >= {"prompt", "answer", "task", "problem"} and row["task"] == name
        [message] = row["prompt"]
        assert message["role"] == "user" and message["content"].strip()
        assert isinstance(row["answer"], str) and row["answer"].strip()
    assert len({frozenset(r) for r in rows}) == 1  # the same columns in every row, as staging requires


def test_arithmetic_rows_state_the_answer_format_and_are_solved():
    rows = get_task("arithmetic").rows("train", 350, seed=1)
    for row in rows:
        text = row["prompt"][0]["content"]
        assert text == f"What is {row['problem']}? Reply with only the number."
        assert row["answer"] == str(solve(row["problem"])) and int(row["answer"]) >= 0
        a, op, b = row["problem"].split()
        assert op in "+-×" and 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        if op == "×":
            assert int(a) <= 9 and int(b) <= 9
    ops = [r["problem"].split()[1] for r in rows]
    # the seven strata in turn (none used up yet: the smallest, one-digit differences, has 51 train problems)
    assert {ops.count(op) for op in "+-"} == {150} and ops.count("×") == 50
    assert solve("23 + 58") == 81 and solve("9 - 4") == 5 and solve("7 × 8") == 56


def test_length_rows_carry_their_target():
    for row in get_task("length").rows("eval", 50, seed=2):
        n = row["target_words"]
        assert 3 <= n <= 10 and row["answer"] == str(n)
        assert row["prompt"][0]["content"].endswith(f"in exactly {n} words. Reply with only the description.")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("split", ["train", "eval"])
def test_written_rows_pass_staging(tmp_path, name, split):
    task = get_task(name)
    path = task.write_jsonl(tmp_path / "in" / f"{name}-{split}.jsonl", split, 25, seed=7)
    assert path == tmp_path / "in" / f"{name}-{split}.jsonl"
    staged = stage_dataset(path, tmp_path / "store")
    assert staged.manifest.rows == 25 and staged.manifest.columns[:1] == ["prompt"]
    assert read_staged_rows(staged.manifest_path) == task.rows(split, 25, seed=7)


@pytest.mark.parametrize("bad", [{"split": "test", "n": 5}, {"split": "train", "n": 0}, {"split": "eval", "n": -1},
                                 {"split": "train", "n": 2.5}, {"split": "train", "n": True}])
def test_bad_row_requests_are_value_errors(bad):
    with pytest.raises(ValueError, match="split must be|n must be"):
        get_task("arithmetic").rows(bad["split"], bad["n"], seed=0)


# --- the split: train and eval never share a problem ----------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_problem_is_in_exactly_one_split(name):
    task = get_task(name)
    train, held_out = task.pools("train"), task.pools("eval")
    everything = [k for stratum in task.strata() for k in stratum]
    assert len(everything) == len(set(everything))
    for stratum, tr, ev in zip(task.strata(), train, held_out, strict=True):
        assert set(tr).isdisjoint(ev) and set(tr) | set(ev) == set(stratum)
        assert tr and ev  # both splits have problems of every stratum
    share = sum(map(len, held_out)) / len(everything)
    assert abs(share - EVAL_PERCENT / 100) < 0.06, share


@pytest.mark.parametrize("name", NAMES)
def test_no_seed_or_size_of_train_meets_any_seed_or_size_of_eval(name):
    task = get_task(name)
    eval_all = [k for stratum in task.pools("eval") for k in stratum]
    train_all = [k for stratum in task.pools("train") for k in stratum]
    # Far more rows than the eval split has problems: every eval problem, some more than once.
    eval_rows = [r for seed in range(3) for r in task.rows("eval", len(eval_all) + 17, seed)]
    assert problems(eval_rows) == set(eval_all)
    train_rows = [r for seed in range(4) for n in (1, 10, len(train_all) + 5) for r in task.rows("train", n, seed)]
    assert problems(train_rows) == set(train_all)
    assert problems(train_rows).isdisjoint(problems(eval_rows))
    prompts = {json.dumps(r["prompt"]) for r in train_rows}
    assert prompts.isdisjoint(json.dumps(r["prompt"]) for r in eval_rows)
    assert all(split_of(name, r["problem"]) == "train" for r in train_rows)
    assert all(split_of(name, r["problem"]) == "eval" for r in eval_rows)


def test_rows_repeat_a_problem_only_once_the_split_is_used_up():
    task = get_task("arithmetic")
    size = sum(map(len, task.pools("eval")))
    assert len(problems(task.rows("eval", size, seed=9))) == size


def test_the_split_is_pinned():
    """Changing the hash scheme would move problems a trained model saw into eval: it must not change."""
    assert [split_of("arithmetic", k) for k in ("3 + 4", "23 + 58", "0 × 0", "1 + 0")] == [
        "train", "train", "eval", "eval"]
    assert split_of("length", "the ocean | 5") == "eval" and split_of("length", "a cat | 3") == "train"
    sizes = {name: (sum(map(len, t.pools("train"))), sum(map(len, t.pools("eval")))) for name, t in TASKS.items()}
    assert sizes == {"arithmetic": (12142, 3008), "length": (257, 63)}


# --- arithmetic rewards --------------------------------------------------------------------------


ARITHMETIC_CASES = [
    # (completion, reference, correct, format)
    ("81", "81", 1.0, 1.0),
    (" 81.\n", "81", 1.0, 1.0),
    (chat("81"), "81", 1.0, 1.0),
    ("82", "81", 0.0, 1.0),
    ("23 + 58 = 81", "81", 0.5, 0.5),  # right but verbose: SmolLM2's habit
    (chat("The answer is 81."), "81", 0.5, 0.5),
    ("23 + 58 = 82", "81", 0.0, 0.5),
    ("81, or maybe 82", "81", 0.0, 0.5),  # only the last number counts
    ("Let me think.\nFirst 20 + 50 = 70, then 3 + 8 = 11, so the total is 81", "81", 0.5, 0.25),
    ("81.0", "81", 0.5, 0.5),
    ("-5", "5", 0.0, 1.0),
    ("9 - 4 = 5", 5, 0.5, 0.5),  # an int reference as well as a string
    ("", "81", 0.0, 0.0),
    (chat(""), "81", 0.0, 0.0),
    ([], "81", 0.0, 0.0),
    ("eighty-one", "81", 0.0, 0.0),
]


def test_arithmetic_rewards_on_hand_written_completions():
    completions = [c for c, *_ in ARITHMETIC_CASES]
    answers = [a for _, a, *_ in ARITHMETIC_CASES]
    correct = arithmetic_correct(completions=completions, answer=answers, prompts=[None] * len(answers))
    fmt = arithmetic_format(completions=completions, answer=answers)
    assert correct == [c for *_, c, _ in ARITHMETIC_CASES]
    assert fmt == [f for *_, f in ARITHMETIC_CASES]


def test_accuracy_is_the_exact_match_of_the_answer_number():
    completions = ["81", "23 + 58 = 81", "82", "", chat("It is 81.")]
    assert accuracy(completions, ["81"] * 5) == pytest.approx(3 / 5)
    assert accuracy(completions, ["81"] * 5, strict=True) == pytest.approx(1 / 5)
    assert extract_answer("3 + 4 = 7") == 7 and extract_answer("no number") is None
    assert extract_answer("23-5=18") == 18 and extract_answer("it is = -5") == -5
    with pytest.raises(ValueError, match="no completions"):
        accuracy([], [])


# --- length rewards ------------------------------------------------------------------------------


def test_words_are_counted_as_the_prompt_says():
    assert word_count("The ocean is deep and blue.") == 6
    assert word_count("Don't stop: well-known, sun-lit waves!") == 5
    assert word_count("  \n ... !") == 0 and word_count("") == 0
    assert word_count("Three 3 words") == 3


def test_length_rewards_on_hand_written_completions():
    completions = ["Vast, deep, blue, endless water.",  # 5 words: on target
                   chat("Deep blue water."),  # 3
                   "Sure! Here is a five word description of the ocean: vast deep blue endless water.",  # 16
                   "",
                   chat("Blue")]
    targets = [5, 5, 5, 5, 1]
    graded = length_constraint(completions=completions, target_words=targets, answer=[str(t) for t in targets])
    assert graded == pytest.approx([1.0, 1 - 2 / 5, 0.0, 0.0, 1.0])
    assert constraint_met(completions=completions, target_words=targets) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert length_constraint(["a b c d e f"], ["5"]) == pytest.approx([0.8])  # a text target is read too


# --- every reward function: one float in [0, 1] per completion, or a clear error -------------------


def columns_of(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}


ODD = ["", "   ", "\n\n", "NaN", "inf", "-", ".", "1e309", "9" * 500, "½", "٣", "🙂", "a" * 5000,
       [], [{"role": "assistant", "content": None}], [{"role": "assistant", "content": "7"}, {"role": "user"}]]


@pytest.mark.parametrize("name", NAMES)
def test_every_reward_is_a_finite_float_in_the_unit_interval(name):
    task = get_task(name)
    rows = task.rows("eval", len(ODD), seed=0)
    for func in load_reward_funcs(list(task.reward_funcs)):
        values = func(prompts=[r["prompt"] for r in rows], completions=ODD, completion_ids=[[]] * len(ODD),
                      **columns_of(rows))
        assert len(values) == len(ODD)
        assert all(type(v) is float and math.isfinite(v) and 0.0 <= v <= 1.0 for v in values), (func, values)


@pytest.mark.parametrize("name", NAMES)
def test_the_rewards_load_by_import_path_and_score_the_rows(name):
    task = get_task(name)
    funcs = load_reward_funcs(list(task.reward_funcs))
    assert [f"{f.__module__}:{f.__name__}" for f in funcs] == list(task.reward_funcs)
    rows = task.rows("train", 4, seed=0)
    perfect = [r["answer"] if name == "arithmetic" else " ".join(["word"] * r["target_words"]) for r in rows]
    totals = score(funcs, list(task.reward_weights), [r["prompt"] for r in rows], [chat(p) for p in perfect],
                   [[]] * 4, columns_of(rows))
    assert totals == pytest.approx([sum(task.reward_weights)] * 4)


@pytest.mark.parametrize("func,column", [(arithmetic_correct, "answer"), (length_constraint, "target_words"),
                                         (constraint_met, "target_words")])
def test_mismatched_lengths_are_clear_errors(func, column):
    with pytest.raises(ValueError, match=rf"{func.__name__}: 2 completions but 3 {column} values"):
        func(["1", "2"], **{column: ["1", "2", "3"]})


@pytest.mark.parametrize("func,column,value,message", [
    (arithmetic_correct, "answer", "eighty", r"answer\[0\] is 'eighty', not a whole number"),
    (arithmetic_correct, "answer", None, r"answer\[0\] is None, not a whole number"),
    (length_constraint, "target_words", 0, r"target_words\[0\] is 0, not a positive number of words"),
    (constraint_met, "target_words", "x", r"target_words\[0\] is 'x', not a whole number"),
])
def test_bad_references_are_clear_errors(func, column, value, message):
    with pytest.raises(ValueError, match=message):
        func(["7"], **{column: [value]})


@pytest.mark.parametrize("completions", ["7", None, [None], [7]])
def test_completions_that_are_not_text_are_type_errors(completions):
    with pytest.raises(TypeError, match=r"arithmetic_format: complet"):
        arithmetic_format(completions)


def test_answer_correct_scores_each_reply_as_accuracy_averages_them():
    from posttrain.tasks.arithmetic import accuracy, answer_correct

    replies = ["81", "23 + 58 = 81", "82", "no idea", [{"role": "assistant", "content": "It is 81."}]]
    scores = answer_correct(replies, ["81"] * 5)
    assert scores == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert sum(scores) / len(scores) == accuracy(replies, ["81"] * 5)
