"""The checkpoint watch: completeness rules, order, cursor, rotation, termination."""

from __future__ import annotations

import json
import shutil

import pytest

from posttrain.runs.watch import load_cursor, watch_checkpoints
from posttrain.trainer.checkpoints import (
    IncompleteCheckpoint,
    complete_checkpoints,
    inspect_checkpoint,
    last_complete_checkpoint,
)


def _done_after(n_polls: int, action=None):
    """is_job_done that says False n_polls times (running ``action(poll)`` each time), then True."""
    polls = {"n": 0}

    def is_done() -> bool:
        polls["n"] += 1
        if action is not None:
            action(polls["n"])
        return polls["n"] > n_polls

    return is_done


def _steps(infos):
    return [i.step for i in infos]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"state": False}, "trainer_state.json: missing"),
        ({"config": False}, "config.json: missing"),
        ({"truncate": "model.safetensors"}, "truncated"),
        ({"shards": 3, "truncate": "model-00002-of-00003.safetensors"}, "truncated"),
    ],
)
def test_incomplete_checkpoints_are_rejected(tmp_path, make_checkpoint, kwargs, reason):
    path = make_checkpoint(tmp_path, 5, **kwargs)
    with pytest.raises(IncompleteCheckpoint, match=reason):
        inspect_checkpoint(path)


def test_complete_and_sharded_checkpoints_are_described(tmp_path, make_checkpoint):
    info = inspect_checkpoint(make_checkpoint(tmp_path, 7, shards=2))
    assert info.step == 7
    assert info.weight_files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert info.weight_bytes == sum((info.path / f).stat().st_size for f in info.weight_files)
    path = make_checkpoint(tmp_path, 8, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(IncompleteCheckpoint):
        inspect_checkpoint(path)
    sentinel = make_checkpoint(tmp_path, 9)
    (sentinel / "checkpoint-is-incomplete.txt").write_text("busy")
    with pytest.raises(IncompleteCheckpoint, match="checkpoint-is-incomplete"):
        inspect_checkpoint(sentinel)
    state = json.loads((path.parent / "checkpoint-7" / "trainer_state.json").read_text())
    (path.parent / "checkpoint-7" / "trainer_state.json").write_text(json.dumps({**state, "policy_version": 3}))
    assert inspect_checkpoint(path.parent / "checkpoint-7").policy_version == 3


def test_yields_in_step_order_and_ignores_partial_folders(tmp_path, make_checkpoint):
    out = tmp_path / "out"
    for step in (10, 2, 30):
        make_checkpoint(out, step)
    make_checkpoint(out, 40, name="tmp-checkpoint-40")
    make_checkpoint(out, 50, state=False)  # still being written when the job is done
    skipped = []
    infos = list(
        watch_checkpoints(
            out, cursor_path=tmp_path / "cursor.json", is_job_done=lambda: True, poll_interval=0, on_skip=skipped.append
        )
    )
    assert _steps(infos) == [2, 10, 30]
    assert [(s.step, s.reason) for s in skipped] == [(50, "still incomplete when the job ended")]
    assert _steps(complete_checkpoints(out)) == [2, 10, 30]
    assert last_complete_checkpoint(out).step == 30


def test_waits_for_checkpoints_that_appear_and_complete_later(tmp_path, make_checkpoint):
    out = tmp_path / "out"

    def trainer(poll: int) -> None:  # what the "training job" has written by each poll
        if poll == 2:
            make_checkpoint(out, 1, state=False)  # weights written, trainer_state not yet
        if poll == 3:
            (out / "checkpoint-1" / "trainer_state.json").write_text("{}")
        if poll == 4:
            make_checkpoint(out, 2)

    sleeps = []
    infos = watch_checkpoints(
        out, cursor_path=tmp_path / "c.json", is_job_done=_done_after(4, trainer), poll_interval=7, sleep=sleeps.append
    )
    assert _steps(infos) == [1, 2]
    assert sleeps == [7, 7, 7, 7]


def test_cursor_resumes_after_the_last_handled_checkpoint(tmp_path, make_checkpoint):
    out, cursor = tmp_path / "out", tmp_path / "state" / "cursor.json"
    for step in (1, 2, 3):
        make_checkpoint(out, step)
    first = watch_checkpoints(out, cursor_path=cursor, is_job_done=lambda: False, poll_interval=0)
    assert next(first).step == 1
    assert next(first).step == 2  # asking for 2 acknowledges 1
    first.close()  # the consumer stops while handling 2
    assert load_cursor(cursor, out).last_step == 1
    make_checkpoint(out, 4)
    again = watch_checkpoints(out, cursor_path=cursor, is_job_done=lambda: True, poll_interval=0)
    assert _steps(again) == [2, 3, 4]  # 2 again: at-least-once
    assert load_cursor(cursor, out).last_step == 4
    assert list(watch_checkpoints(out, cursor_path=cursor, is_job_done=lambda: True)) == []
    with pytest.raises(ValueError, match="belongs to"):
        load_cursor(cursor, tmp_path / "elsewhere")


def test_rotation_skips_deleted_checkpoints_without_blocking(tmp_path, make_checkpoint):
    out = tmp_path / "out"
    make_checkpoint(out, 1, state=False)  # seen while incomplete...

    def trainer(poll: int) -> None:
        if poll == 2:  # ...then finished and rotated away (save_total_limit) between two polls
            shutil.rmtree(out / "checkpoint-1")
            make_checkpoint(out, 2)
            make_checkpoint(out, 3)

    skipped = []
    infos = list(
        watch_checkpoints(
            out,
            cursor_path=tmp_path / "c.json",
            is_job_done=_done_after(2, trainer),
            poll_interval=0,
            on_skip=skipped.append,
        )
    )
    assert _steps(infos) == [2, 3]
    assert [s.step for s in skipped] == [1] and "deleted" in skipped[0].reason
    assert load_cursor(tmp_path / "c.json", out).skipped == [1]


def test_a_dead_partial_does_not_block_later_checkpoints(tmp_path, make_checkpoint):
    out = tmp_path / "out"
    make_checkpoint(out, 1, truncate="model.safetensors")  # left by a killed attempt
    make_checkpoint(out, 2)
    skipped = []
    infos = list(
        watch_checkpoints(
            out, cursor_path=tmp_path / "c.json", is_job_done=_done_after(1), poll_interval=0, on_skip=skipped.append
        )
    )
    assert _steps(infos) == [2]
    assert "still incomplete while checkpoint-2 is complete" in skipped[0].reason


def test_missing_output_dir_is_waited_for(tmp_path, make_checkpoint):
    out = tmp_path / "not-yet"
    infos = watch_checkpoints(
        out,
        cursor_path=tmp_path / "c.json",
        is_job_done=_done_after(2, lambda poll: poll == 2 and make_checkpoint(out, 5)),
        poll_interval=0,
    )
    assert _steps(infos) == [5]
