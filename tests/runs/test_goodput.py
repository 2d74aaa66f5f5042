"""Goodput accounting (posttrain.runs.goodput) on synthetic timelines (posttrain.trainer.timeline):
one attempt, a requeue with work redone, a graceful stop, publishing that overlaps training, GRPO rounds."""

from __future__ import annotations

import json

import pytest

from posttrain.runs.goodput import CATEGORIES, JobTimeline, Span, compute_goodput, job_spans, paint
from posttrain.trainer.timeline import Timeline, parse_timeline, read_timeline, timeline_file_for


def lines(attempt: str, *events: tuple) -> list[str]:
    """Timeline lines of one attempt: (event, t) or (event, t, {fields})."""
    out = []
    for e in events:
        fields = e[2] if len(e) > 2 else {}
        out.append(json.dumps({"event": e[0], "t": e[1], "attempt": attempt, **fields}))
    return out


def finished_attempt(name: str, start: float, loaded: float, saves: list[tuple[float, float]], end: float) -> list[str]:
    events = [("start", start), ("loaded", loaded)]
    for i, (b, e) in enumerate(saves):
        events += [("step_begin", b - 1, {"step": i + 1}), ("step_end", b, {"step": i + 1}),
                   ("save_begin", b, {"step": i + 1}), ("save_end", e, {"step": i + 1})]
    events.append(("end", end, {"completed": True}))
    return lines(name, *events)


def total(g) -> float:
    return sum(g.seconds.values())


def test_one_attempt_splits_the_wall_time_and_publishing_overlapping_training_does_not_count():
    attempts = parse_timeline(finished_attempt("a", 10, 14, [(20, 21), (30, 32)], 40))
    job = JobTimeline(submitted_at=5, attempts=attempts)
    waits = [Span("publish", 21, 25), Span("publish", 32, 44), Span("hot-load", 44, 46)]
    g = compute_goodput(0, 50, [job], waits)
    s = g.seconds
    assert (s["queue"], s["startup"], s["checkpoint"], s["training"]) == (5, 4, 3, 23)
    assert s["publish"] == 4 and s["hot-load"] == 2  # only after the job ended (40 -> 44, 44 -> 46)
    assert s["lost"] == 0 and g.restarts == 0 and g.lost_redone_s == 0
    assert s["orchestration"] == 5 + 4  # 0 -> 5 before the submit, 46 -> 50 after the hot-load
    assert total(g) == pytest.approx(g.wall_s) == 50
    assert g.goodput == pytest.approx(23 / 50)
    assert set(s) == set(CATEGORIES)


def test_a_requeue_counts_the_work_redone_since_the_last_checkpoint_and_the_restart_gap():
    # attempt 1 saved at 30-32, trained on (steps 3 and 4 begun), was killed after its record at 40;
    # attempt 2 started at 50 and resumed from that checkpoint.
    first = lines("a1", ("start", 10), ("loaded", 15), ("step_begin", 16, {"step": 1}), ("step_end", 29, {"step": 1}),
                  ("save_begin", 30), ("save_end", 32), ("step_begin", 33, {"step": 2}), ("step_end", 37, {"step": 2}),
                  ("step_begin", 38, {"step": 3}), ("step_end", 40, {"step": 3}))
    second = finished_attempt("a2", 50, 53, [(60, 62)], 70)
    attempts = parse_timeline(second + first)  # read in any order: attempts sort by start
    assert [a.id for a in attempts] == ["a1", "a2"] and not attempts[0].finished and attempts[1].finished
    g = compute_goodput(0, 75, [JobTimeline(submitted_at=2, attempts=attempts)], [])
    s = g.seconds
    assert s["lost"] == 50 - 32  # from the last completed save to the next start
    assert (g.lost_redone_s, g.lost_restart_s, g.steps_redone, g.restarts) == (8, 10, 2, 1)
    assert s["startup"] == 5 + 3 and s["checkpoint"] == 2 + 2
    assert s["training"] == (32 - 15 - 2) + (70 - 53 - 2)
    assert s["queue"] == 8 and s["orchestration"] == 2 + 5
    assert total(g) == pytest.approx(75)


def test_a_graceful_stop_loses_only_the_restart_gap():
    first = lines("a1", ("start", 0), ("loaded", 2), ("save_begin", 9), ("save_end", 10),
                  ("end", 11, {"completed": False, "stopped_early": True}))
    second = finished_attempt("a2", 30, 31, [], 40)
    g = compute_goodput(0, 40, [JobTimeline(0, parse_timeline(first + second))], [])
    assert g.seconds["lost"] == 20 and (g.lost_redone_s, g.lost_restart_s) == (1, 19)  # its exit, then the gap
    assert g.seconds["training"] == 7 + 9 and total(g) == pytest.approx(40)


def test_an_attempt_killed_before_its_model_loaded_and_a_failed_last_attempt():
    first = lines("a1", ("start", 0, {"recorded": 1}))  # died during start-up; its last record is the start line's
    last = lines("a2", ("start", 5), ("loaded", 6), ("save_begin", 8), ("save_end", 9), ("step_begin", 10))
    g = compute_goodput(0, 20, [JobTimeline(0, parse_timeline(first + last))], [])
    s = g.seconds
    assert s["startup"] == 1 + 1 and s["lost"] == 4 + 1  # 1 -> 5, then 9 -> 10 (no next attempt: its last record)
    assert s["training"] == 2 and s["checkpoint"] == 1 and s["orchestration"] == 10
    assert total(g) == pytest.approx(20)


def test_grpo_rounds_sampling_and_jobs_add_up():
    jobs, waits = [], []
    for r in range(3):
        t = 100 * r
        waits += [Span("publish", t, t + 5), Span("hot-load", t + 5, t + 8), Span("sampling", t + 8, t + 40)]
        jobs.append(JobTimeline(t + 41, parse_timeline(finished_attempt(f"r{r}", t + 45, t + 55, [(t + 80, t + 85)],
                                                                        t + 86))))
    g = compute_goodput(0, 300, jobs, waits)
    s = g.seconds
    assert (s["publish"], s["hot-load"], s["sampling"]) == (15, 9, 96)
    assert (s["queue"], s["startup"], s["training"], s["checkpoint"]) == (12, 30, 3 * 26, 15)
    assert total(g) == pytest.approx(300) and s["orchestration"] == pytest.approx(300 - 15 - 9 - 96 - 12 - 30 - 78 - 15)


def test_spans_are_clipped_to_the_window_and_overlaps_never_double_count():
    spans = [Span("training", -10, 5), Span("publish", 0, 20), Span("checkpoint", 3, 4), Span("lost", 8, 7)]
    s = paint(0, 10, spans)
    assert (s["training"], s["checkpoint"], s["publish"], s["orchestration"]) == (4, 1, 5, 0)
    assert sum(s.values()) == 10 and min(s.values()) >= 0


def test_no_timeline_leaves_the_job_time_to_orchestration():
    g = compute_goodput(0, 10, [JobTimeline(1, [])], [Span("publish", 2, 3)])
    assert g.seconds["orchestration"] == 9 and g.goodput == 0 and g.attempts == 0
    assert job_spans(JobTimeline(None, [])) == []


def test_the_recorder_appends_whole_lines_and_the_reader_skips_a_torn_one(tmp_path):
    path = tmp_path / "out" / ".posttrain" / "run-1.timeline.jsonl"
    assert timeline_file_for(tmp_path / "run-1.results.jsonl") == str(tmp_path / "run-1.timeline.jsonl")
    tl = Timeline(path)
    tl.start()
    tl.mark("loaded")
    with tl.span("save", step=1):
        pass
    with open(path, "a") as f:
        f.write('{"event": "step_beg')  # killed mid-write
    (a,) = read_timeline(path)
    assert a.id == tl.attempt and a.start == tl.started and a.loaded is not None and len(a.saves) == 1
    assert a.start <= a.loaded and not a.finished
    Timeline(None).mark("loaded")  # no path: records nothing
    assert read_timeline(tmp_path / "missing.jsonl") == []


def test_a_resident_trainers_waits_for_rounds_are_not_training():
    # Loaded at 14; waits for round 0 (14 -> 20) and round 1 (25 -> 33) while the flow samples;
    # each round's update and save follow; it ends at 40.
    events = [("start", 10), ("loaded", 14),
              ("round_wait_begin", 14, {"round": 0}), ("round_wait_end", 20, {"round": 0}),
              ("step_begin", 20, {"step": 1}), ("step_end", 23, {"step": 1}),
              ("save_begin", 23, {"step": 1}), ("save_end", 25, {"step": 1}),
              ("round_wait_begin", 25, {"round": 1}), ("round_wait_end", 33, {"round": 1}),
              ("step_begin", 33, {"step": 2}), ("step_end", 36, {"step": 2}),
              ("save_begin", 36, {"step": 2}), ("save_end", 38, {"step": 2}), ("end", 40, {"completed": True})]
    (attempt,) = parse_timeline(lines("r", *events))
    assert attempt.waits == [(14, 20), (25, 33)]
    job = JobTimeline(submitted_at=8, attempts=[attempt])
    waits = [Span("sampling", 12, 20), Span("publish", 25, 27), Span("hot-load", 27, 28), Span("sampling", 28, 32)]
    s = compute_goodput(0, 40, [job], waits).seconds
    assert (s["queue"], s["startup"], s["checkpoint"]) == (2, 4, 4)
    assert s["training"] == 3 + 3 + 2  # the updates, and the end (38 -> 40); not the waits
    assert (s["sampling"], s["publish"], s["hot-load"]) == (6 + 4, 2, 1)  # where no job time covers them
    assert s["orchestration"] == 8 + 1  # before the submit; 32 -> 33 (the trainer seeing the marker)
    assert total_seconds(s) == 40


def total_seconds(seconds: dict) -> float:
    return sum(seconds.values())
