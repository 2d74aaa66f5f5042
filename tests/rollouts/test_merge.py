"""Merging shard files into the round's rollouts file: whole or not at all."""

from __future__ import annotations

import json
import os

import pytest

from posttrain.rollouts.shard import merge_rollouts


def test_merge_concatenates_shards_and_skips_blank_lines(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"i": 1}\n\n{"i": 2}\n')
    b.write_text('{"i": 3}\n')
    out = merge_rollouts([a, b], tmp_path / "round" / "rollouts.jsonl")
    assert [json.loads(line)["i"] for line in out.read_text().splitlines()] == [1, 2, 3]


def test_a_torn_shard_leaves_the_previous_file_and_no_temporary_file(tmp_path):
    good, torn = tmp_path / "good.jsonl", tmp_path / "torn.jsonl"
    good.write_text('{"i": 1}\n')
    torn.write_text('{"i": 2}\n{"i": ')
    out = tmp_path / "round" / "rollouts.jsonl"
    merge_rollouts([good], out)
    with pytest.raises(json.JSONDecodeError):
        merge_rollouts([good, torn], out)
    assert os.listdir(out.parent) == ["rollouts.jsonl"]
    assert out.read_text() == '{"i": 1}\n'
