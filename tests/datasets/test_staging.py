"""Staging prompt datasets onto shared storage."""

from __future__ import annotations

import json

import pytest

from posttrain.datasets.staging import (
    DIGEST_PREFIX_CHARS,
    MAX_REPORTED_PROBLEMS,
    StagingError,
    read_staged_rows,
    stage_dataset,
)
from posttrain.datasets.toy import toy_prompt_rows, write_toy_jsonl


def test_stages_a_good_file(tmp_path):
    source = write_toy_jsonl(tmp_path / "toy.jsonl", n=6)
    staged = stage_dataset(source, tmp_path / "store")
    m = staged.manifest
    assert not staged.already_staged
    assert staged.manifest_path == tmp_path / "store" / "datasets" / m.digest[:DIGEST_PREFIX_CHARS] / "manifest.json"
    assert (m.rows, m.columns, m.source) == (6, ["prompt", "answer", "task"], str(source))
    assert read_staged_rows(staged.manifest_path) == [
        {"prompt": r["prompt"], "answer": r["answer"], "task": r["task"]} for r in toy_prompt_rows(6)
    ]
    assert json.loads(staged.manifest_path.read_text())["digest"] == m.digest
    leftovers = [p.name for p in (tmp_path / "store" / "datasets").iterdir()]
    assert leftovers == [m.digest[:DIGEST_PREFIX_CHARS]]  # no temp folders left behind


def test_restaging_is_a_no_op(tmp_path):
    source = write_toy_jsonl(tmp_path / "a.jsonl", n=4)
    first = stage_dataset(source, tmp_path / "store")
    before = first.data_path.stat().st_mtime_ns
    # Same rows, different formatting and file name: same digest, nothing copied.
    relaid = tmp_path / "b.jsonl"
    lines = [json.dumps(r, separators=(", ", ": ")) for r in toy_prompt_rows(4)]
    relaid.write_text("\n".join(lines) + "\n\n")
    second = stage_dataset(relaid, tmp_path / "store")
    assert second.already_staged
    assert second.manifest == first.manifest  # the original manifest, source included
    assert second.data_path.stat().st_mtime_ns == before


def test_bad_rows_are_listed_by_line_and_nothing_is_staged(tmp_path, write_jsonl):
    good = toy_prompt_rows(1)[0]
    source = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            good,
            "{not json",
            {"answer": "1"},  # no prompt
            {**good, "prompt": [{"role": "robot", "content": "hi"}]},
            {**good, "prompt": [{"role": "user", "content": [{"type": "image"}]}]},
            {**good, "prompt": []},
            {"prompt": good["prompt"], "answer": "2"},  # lacks 'task'
            [1, 2],
            {**good, "answer": float("nan")},
            good,
        ],
    )
    with pytest.raises(StagingError) as info:
        stage_dataset(source, tmp_path / "store")
    problems = info.value.problems
    text = str(info.value)
    assert str(source) in text and "nothing staged" in text
    by_line = {}
    for p in problems:
        where, _, what = p.partition(": ")
        by_line.setdefault(where, []).append(what)
    assert list(by_line) == [f"line {n}" for n in (2, 3, 4, 5, 6, 7, 8, 9)]
    assert "not valid JSON" in by_line["line 2"][0]
    assert "missing column 'prompt'" in by_line["line 3"][0]
    assert "role must be one of" in by_line["line 4"][0]
    assert "content must be text" in by_line["line 5"][0]
    assert "non-empty list" in by_line["line 6"][0]
    assert "missing column(s) ['task']" in by_line["line 7"][0]
    assert "expected a JSON object" in by_line["line 8"][0]
    assert "NaN" in by_line["line 9"][0]
    assert not (tmp_path / "store").exists()  # not even a folder was created


def test_problem_listing_is_capped(tmp_path, write_jsonl):
    source = write_jsonl(tmp_path / "bad.jsonl", ["nope"] * 30)
    with pytest.raises(StagingError) as info:
        stage_dataset(source, tmp_path / "store")
    assert len(info.value.problems) == 30
    assert str(info.value).count("\n  - ") == MAX_REPORTED_PROBLEMS and "... and 10 more" in str(info.value)


def test_parquet_input_matches_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = toy_prompt_rows(5)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "toy.parquet", row_group_size=2)
    from_parquet = stage_dataset(tmp_path / "toy.parquet", tmp_path / "store")
    from_jsonl = stage_dataset(write_toy_jsonl(tmp_path / "toy.jsonl", n=5), tmp_path / "store")
    assert from_parquet.manifest.rows == 5
    assert from_jsonl.already_staged and from_jsonl.manifest.digest == from_parquet.manifest.digest


def test_parquet_bad_rows_report_row_numbers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = toy_prompt_rows(4)
    rows[2]["prompt"] = [{"role": "wizard", "content": "x"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(StagingError) as info:
        stage_dataset(tmp_path / "bad.parquet", tmp_path / "store")
    assert [p.split(":")[0] for p in info.value.problems] == ["row 3"]


@pytest.mark.parametrize(
    ("dest", "source_name", "message"),
    [("relative/store", "toy.jsonl", "must be an absolute path"), (None, "toy.csv", "unknown file type")],
)
def test_rejects_bad_arguments(tmp_path, dest, source_name, message):
    source = write_toy_jsonl(tmp_path / source_name, n=2)
    with pytest.raises(StagingError, match=message):
        stage_dataset(source, dest or tmp_path / "store")


def test_tampered_data_fails_verification(tmp_path):
    staged = stage_dataset(write_toy_jsonl(tmp_path / "toy.jsonl", n=2), tmp_path / "store")
    staged.data_path.write_text(staged.data_path.read_text().replace("What", "Wat"))
    with pytest.raises(StagingError, match="do not match the digest"):
        read_staged_rows(staged.manifest_path)


def _good_line(i: int = 0) -> str:
    return json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)})


def test_a_bad_byte_is_reported_on_its_own_line(tmp_path):
    lines = [_good_line(i).encode() for i in range(6000)]
    lines[5000] = b'{"prompt": [{"role": "user", "content": "caf\xe9"}], "answer": "x"}'  # line 5001: Latin-1
    source = tmp_path / "bad.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(StagingError) as e:
        stage_dataset(source, tmp_path / "store")
    assert e.value.problems == ["line 5001: not UTF-8 (invalid continuation byte at byte 45 of the line)"]


@pytest.mark.parametrize(("text", "expected"), [
    ("[" * 100_000 + "]" * 100_000, "line 2: cannot be read: JSON nested too deeply"),
    ('{"prompt": [{"role": "user", "content": "q"}], "answer": ' + "9" * 5000 + "}",
     "line 2: cannot be read: Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits"),
])
def test_json_a_parser_cannot_hold_is_a_problem_of_its_line(tmp_path, text, expected):
    source = tmp_path / "bad.jsonl"
    source.write_text(_good_line() + "\n" + text + "\n" + _good_line(1) + "\n")
    with pytest.raises(StagingError) as e:
        stage_dataset(source, tmp_path / "store")
    assert e.value.problems == [expected]


def test_a_destination_that_cannot_hold_folders_is_one_error(tmp_path):
    source = tmp_path / "ok.jsonl"
    source.write_text(_good_line() + "\n")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(StagingError, match=f"^dest {a_file}: is a file, not a folder$"):
        stage_dataset(source, a_file)
    with pytest.raises(StagingError, match="^dest /proc/self: cannot write the dataset there"):
        stage_dataset(source, "/proc/self")


def test_stage_command_errors_are_one_line(tmp_path, capsys):
    from posttrain.cli import main

    source = tmp_path / "ok.jsonl"
    source.write_text(_good_line() + "\n")
    (tmp_path / "file").write_text("x")
    assert main(["stage", str(source), "--dest", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err == f"posttrain: error: dest {tmp_path / 'file'}: is a file, not a folder\n"
