"""The job's results file is appended in place by the trainer and read by whoever follows the job
(a flow run, a retried one): a read can catch the last line half written, or, on an NFS client,
the file's new size before its bytes (NULs). Those are "not written yet", never an error; a bad
line before them is an error naming the file and the line. The same for the trainer's timeline."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from posttrain.fsutil import written_lines
from posttrain.runs.job import ResultsFileError, read_results, results_path
from posttrain.trainer.config import TrainingResult
from posttrain.trainer.timeline import Timeline, read_timeline

NAME, RUN_ID = "job", "r1"
LINES = 300


def result(step: int) -> TrainingResult:
    return TrainingResult(mode="resident", global_step=step, policy_version=step, completed=False,
                          stopped_early=True, rounds_done=step, metrics={"loss": 0.5, "reward": float(step)})


def results_file(tmp_path: Path) -> Path:
    path = Path(results_path(tmp_path, NAME, RUN_ID))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def line(step: int) -> bytes:
    return result(step).model_dump_json().encode() + b"\n"


def test_a_last_line_without_its_newline_is_not_written_yet(tmp_path):
    path = results_file(tmp_path)
    whole = line(1) + line(2)
    for cut in range(len(line(1)), len(whole)):  # every torn state of the second line
        path.write_bytes(whole[:cut])
        assert [r.global_step for r in read_results(tmp_path, NAME, RUN_ID)] == [1], cut
    path.write_bytes(whole)
    assert [r.global_step for r in read_results(tmp_path, NAME, RUN_ID)] == [1, 2]
    path.write_bytes(line(1)[:10])
    assert read_results(tmp_path, NAME, RUN_ID) == []


@pytest.mark.parametrize("tail", [b"\0" * 7, b"\0" * 4096], ids=["7 NULs", "a page of NULs"])
def test_trailing_nuls_are_not_written_yet(tmp_path, tail):
    # What an NFS client may read after the file grew and before its bytes arrived.
    path = results_file(tmp_path)
    path.write_bytes(line(1) + tail)
    assert [r.global_step for r in read_results(tmp_path, NAME, RUN_ID)] == [1]
    path.write_bytes(line(1) + line(2)[:20] + tail)  # half a line, then NULs
    assert [r.global_step for r in read_results(tmp_path, NAME, RUN_ID)] == [1]
    path.write_bytes(tail)
    assert read_results(tmp_path, NAME, RUN_ID) == []


def test_a_bad_line_before_the_last_is_an_error_naming_the_file_and_line(tmp_path):
    path = results_file(tmp_path)
    path.write_bytes(line(1) + b'{"mode": "resident", "glo\n' + line(3))
    with pytest.raises(ResultsFileError) as raised:
        read_results(tmp_path, NAME, RUN_ID)
    assert str(raised.value).startswith(f"{path}, line 2: not a trainer result")
    assert "\n" not in str(raised.value)
    path.write_bytes(line(1) + b"\0\0\0\n" + line(3))  # NULs with a newline after them are not a torn tail
    with pytest.raises(ResultsFileError, match=", line 2: "):
        read_results(tmp_path, NAME, RUN_ID)


def test_written_lines_numbers_the_finished_lines(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"a\n\nb\nc")
    assert written_lines(path) == [(1, b"a"), (2, b""), (3, b"b")]
    path.write_bytes(b"")
    assert written_lines(path) == []
    with pytest.raises(FileNotFoundError):
        written_lines(tmp_path / "missing")


def append_slowly(path: str, count: int) -> None:
    """The writer: appends ``count`` results, each in ways a reader can catch half done: a line in
    three writes, or the file grown first (NULs) and its bytes written after (as an NFS client may
    see it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # not O_APPEND: pwrite would append on Linux
    try:
        for step in range(1, count + 1):
            data, end = line(step), os.fstat(fd).st_size
            if step % 2:
                third = len(data) // 3
                for start, stop in ((0, third), (third, 2 * third), (2 * third, len(data))):
                    os.pwrite(fd, data[start:stop], end + start)
                    time.sleep(0.0005)
            else:
                os.ftruncate(fd, end + len(data))
                time.sleep(0.0005)
                os.pwrite(fd, data[:-1], end)
                time.sleep(0.0005)
                os.pwrite(fd, data[-1:], end + len(data) - 1)
    finally:
        os.close(fd)


def test_a_reader_following_a_live_appender_never_fails(tmp_path):
    path = results_file(tmp_path)
    path.touch()
    writer = multiprocessing.get_context("spawn").Process(target=append_slowly, args=(str(path), LINES))
    writer.start()
    seen, reads, torn = 0, 0, 0
    deadline = time.monotonic() + 120
    try:
        while seen < LINES:
            assert time.monotonic() < deadline, f"read {seen} of {LINES} results in 120 s"
            raw = path.read_bytes()
            found = read_results(tmp_path, NAME, RUN_ID)  # never raises on a line being written
            reads += 1
            torn += bool(raw) and not raw.endswith(b"\n")
            assert [r.global_step for r in found] == list(range(1, len(found) + 1))
            assert len(found) >= seen  # what was read stays read
            seen = len(found)
    finally:
        writer.join(timeout=60)
    assert writer.exitcode == 0
    assert torn > 0, f"no read caught a line half written in {reads} reads"  # the race was run
    print(f"{reads} reads, {torn} of them while a line was half written")


def test_the_timeline_reader_leaves_out_a_line_being_written(tmp_path):
    path = tmp_path / "run.timeline.jsonl"
    tl = Timeline(path)
    tl.start()
    tl.mark("loaded")
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"event": "end", "t": 1, "attempt": "' + tl.attempt.encode() + b'", "completed": true' + b"\0" * 64)
    (attempt,) = read_timeline(path)
    assert attempt.loaded is not None and not attempt.finished
    path.write_bytes(whole + b"\0" * 64)
    (attempt,) = read_timeline(path)
    assert attempt.loaded is not None
