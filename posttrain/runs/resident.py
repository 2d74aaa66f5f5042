"""A run's training job as a pipeline drives it, in one object (no Prefect): ``RunJob`` follows a
job submitted once (``once.submit_once``: a retried pipeline finds it by its marker), and
``ResidentRun`` adds the rounds of a GRPO run's resident trainer (``trainer.resident``): hand a
round, wait for its checkpoint, and pick the policy a round samples from under a staleness bound.

Round r of a run from ``model_name_or_path`` at global step s is trained into
``checkpoint-<s + (r + 1) * num_iterations>`` (``trainer.rounds``). "Version" below counts the
rounds trained: version t is the initial policy after t updates (the policy a round sampled from
is recorded as ``v0 + t`` in its rollouts, ``v0`` the initial policy's version).

Asynchronous rounds (``max_staleness`` k > 0): round r may be sampled from any version t with
t >= r - k, so the pipeline samples round r+1 .. r+k while round r trains; ``policy_for`` takes the
newest version trained so far without waiting, and waits (never drops) when the newest is older
than the bound. With k = 0 every round waits for the round before it: synchronous rounds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from posttrain.cluster import ClusterConfig
from posttrain.runs.once import (
    JobRecord,
    cancel_job,
    checkpoints_to_handle,
    completed_result,
    handled_before,
    job_ended,
    live_run,
)
from posttrain.trainer.checkpoints import CheckpointInfo, try_inspect
from posttrain.trainer.config import TrainerConfig, TrainingResult
from posttrain.trainer.rounds import ROLLOUTS_FILE, beat, hand_round, read_ready, round_dir, start_position

log = logging.getLogger(__name__)

#: Lines of a job's log quoted when it ended without the checkpoint a round waited for.
LOG_TAIL_LINES = 20

#: ``on_end(outcome, reason)``: the job's end as the watch saw it; outcome "completed" or "failed".
OnEnd = Callable[[str, str | None], None]


class RunJob:
    """One submitted training job of a run (its ``JobRecord``): the checkpoints an earlier attempt
    handled, those still to handle (once each, in step order, with the run's cursor file), its
    result, why it ended, and cancel. ``on_end`` hears the job's end once the watch saw it."""

    def __init__(self, record: JobRecord, cluster: ClusterConfig | None, *, cursor_path: Path,
                 poll_interval: float, on_end: OnEnd | None = None) -> None:
        self.record, self.cluster = record, cluster
        self.cursor_path, self.poll_interval = Path(cursor_path), poll_interval
        self._on_end = on_end or (lambda outcome, reason: None)

    def handled_before(self) -> list[CheckpointInfo]:
        """Checkpoints an earlier attempt of the pipeline handled (at or before the cursor)."""
        return handled_before(self.record, self.cursor_path)

    def checkpoints(self) -> Iterator[CheckpointInfo]:
        """Each complete checkpoint after the cursor, until the job ended (then ``on_end``)."""
        try:
            yield from checkpoints_to_handle(self.record, self.cluster, cursor_path=self.cursor_path,
                                             poll_interval=self.poll_interval)
        except Exception as e:
            self._on_end("failed", f"{type(e).__name__}: {e}")
            raise
        try:
            completed_result(self.record)
        except Exception as e:  # noqa: BLE001 - ``result`` raises it again for the caller
            self._on_end("failed", str(e))
        else:
            self._on_end("completed", None)

    def result(self) -> TrainingResult:
        """The completed attempt's result; a RuntimeError with the reason when the job did not complete."""
        return completed_result(self.record)

    def end_reason(self) -> str:
        """Why the job ended: the backend's word for a job this process submitted, else its result;
        with its log's last lines."""
        run = live_run(self.record)
        if run is not None:
            reason = run.failure_reason()
        else:
            try:
                completed_result(self.record)
            except RuntimeError as e:
                reason = str(e)
            else:
                reason = "it completed"
        log = Path(self.record.log_path) if self.record.log_path else None
        if log is not None and log.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
            reason += f"\nlast lines of {log}:\n{tail}"
        return reason

    def cancel(self) -> str:
        """Stop the job (``once.cancel_job``); what was done, in words."""
        return cancel_job(self.record, self.cluster)


def ended_unfinished(record: JobRecord, cluster: ClusterConfig | None) -> str | None:
    """Why a job found by its marker ended without completing (it failed, was cancelled, or a
    resident trainer timed out waiting for a round while its flow run was down); None while it runs
    or once it completed. A pipeline submits such a job again: it resumes from its last checkpoint."""
    if not job_ended(record, cluster):
        return None
    try:
        completed_result(record)
    except RuntimeError as e:
        return str(e)
    return None


def retire_if_ended(record: JobRecord, cluster: ClusterConfig | None, marker: Path) -> tuple[Path, str] | None:
    """When the job ``marker`` records ended without completing (``ended_unfinished``): move the
    marker aside, to ``<stem>.<n>.json`` (n = 1, 2, ...: the jobs of the run in order), so the next
    ``submit_once`` with ``marker`` submits again; returns (where it went, why the job ended).
    None while the job runs or once it completed: the marker stays."""
    why = ended_unfinished(record, cluster)
    if why is None:
        return None
    earlier = len(list(marker.parent.glob(f"{marker.stem}.*.json")))
    retired = marker.with_name(f"{marker.stem}.{earlier + 1}.json")
    marker.rename(retired)
    return retired, why


def retired_markers(marker: Path) -> list[Path]:
    """The markers ``retire_if_ended`` moved aside, in the order of their jobs, then ``marker``."""
    earlier = sorted(marker.parent.glob(f"{marker.stem}.*.json"), key=lambda p: int(p.name.split(".")[-2]))
    return [*earlier, marker]


def heartbeat_interval(round_timeout_s: float) -> float:
    """How often the flow beats for a trainer that waits ``round_timeout_s``: several beats per
    timeout (a late or lost write costs nothing), at most every 30 s."""
    return min(30.0, round_timeout_s / 6)


@contextmanager
def keep_rounds_alive(rounds_dir: str | Path, every: float) -> Iterator[None]:
    """While the block runs, a thread rewrites the rounds' heartbeat (``trainer.rounds.beat``) every
    ``every`` seconds: a resident trainer waiting for a round then waits as long as the flow works
    on it (a slow hot-load, a long sampling) and times out only once the flow is gone. A failed
    write is logged and tried again at the next beat; leaving the block stops the beats."""
    stop = threading.Event()

    def beats() -> None:
        count, failing = 0, False
        while True:
            count += 1
            try:
                beat(rounds_dir, count)
            except OSError as e:
                if not failing:
                    log.warning("the rounds' heartbeat could not be written (%s); a waiting trainer times out "
                                "round_timeout_s after the last one", e)
                failing = True
            else:
                failing = False
            if stop.wait(every):
                return

    thread = threading.Thread(target=beats, name="rounds-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=every + 30)  # a write hung on a dead mount must not hold the flow (a daemon thread)
        if thread.is_alive():
            log.warning("the rounds' heartbeat thread is still writing %ss after it was stopped; left behind",
                        every + 30)


@dataclass(frozen=True)
class Policy:
    """The policy a round samples from: ``version`` rounds trained (0: the initial policy) at ``path``."""

    version: int
    path: str


class ResidentRun(RunJob):
    """A GRPO run's resident trainer job (``mode: resident``): rounds handed one at a time, their
    checkpoints followed with the run's watch. A round is done once its checkpoint is complete,
    whichever attempt of the pipeline handed it."""

    def __init__(self, record: JobRecord, cluster: ClusterConfig | None, trainer: TrainerConfig, *,
                 cursor_path: Path, poll_interval: float, on_end: OnEnd | None = None,
                 rounds_dir: Path | None = None) -> None:
        """``rounds_dir``: where this machine sees ``trainer.rounds_dir`` (default: the same path)."""
        assert trainer.mode == "resident" and trainer.rounds_dir is not None and trainer.rounds is not None
        super().__init__(record, cluster, cursor_path=cursor_path, poll_interval=poll_interval, on_end=on_end)
        self.trainer = trainer
        self.rounds_dir = Path(rounds_dir or trainer.rounds_dir)
        self.start_step, self.start_version = start_position(trainer.model_name_or_path)
        self._watch = self.checkpoints()
        self._newest = Policy(0, str(trainer.model_name_or_path))

    def keep_alive(self):
        """A context manager: the flow's heartbeat for the trainer while the block works on the
        rounds (``keep_rounds_alive``, beating several times per ``round_timeout_s``)."""
        return keep_rounds_alive(self.rounds_dir, heartbeat_interval(self.trainer.round_timeout_s))

    # ------------------------------------------------------------------ one round
    def checkpoint_path(self, round: int) -> Path:
        """Where the checkpoint of ``round`` is (as this machine sees the output folder)."""
        step = self.start_step + (round + 1) * self.trainer.num_iterations
        return self.record.local_dir() / f"checkpoint-{step}"

    def trained(self, round: int) -> CheckpointInfo | None:
        """The round's checkpoint when it is complete, else None (no wait)."""
        return try_inspect(self.checkpoint_path(round))

    def sampled(self, round: int) -> bool:
        """Whether the round's rollouts file is written (whole: it is written atomically)."""
        return (round_dir(self.rounds_dir, round) / ROLLOUTS_FILE).is_file()

    def handed(self, round: int) -> list[int] | None:
        """The policy versions (as recorded in the rollouts) of a handed round; None when not handed."""
        ready = read_ready(self.rounds_dir, round)
        return None if ready is None else ready.policy_versions

    def hand(self, round: int, policy_version: int | list[int]) -> None:
        """Hand the round's rollouts (already in its folder) to the trainer, sampled by ``policy_version``
        (or versions: a round an earlier attempt sampled); again is a no-op (the first hand-over stands)."""
        hand_round(self.rounds_dir, round, self.handed(round) or policy_version)

    def wait(self, round: int) -> CheckpointInfo:
        """The round's checkpoint, once the trainer wrote it; a RuntimeError with the job's reason when
        the job ended first."""
        done = self.trained(round)
        if done is not None:  # written already (maybe handled by an earlier attempt: the watch is past it)
            return done
        want = self.checkpoint_path(round)
        for ckpt in self._watch:
            if ckpt.path.name == want.name:
                return ckpt
            if ckpt.step > int(want.name.split("-")[1]):
                raise RuntimeError(f"round {round}: the trainer wrote {ckpt.path.name} instead of {want.name}")
            # an earlier round's
        raise RuntimeError(f"round {round}: training job {self.record.job_id} ended before writing {want.name}: "
                           f"{self.end_reason()}")

    # ------------------------------------------------------------------ the policy a round samples
    def policy_for(self, round: int, max_staleness: int, *, waiting: Callable[[], object] | None = None) -> Policy:
        """The newest policy round ``round`` may sample from: every round trained so far is taken
        without waiting; while the newest is more than ``max_staleness`` versions behind ``round``
        the call waits for the next round's checkpoint (``waiting`` is called once before it waits)."""
        assert max_staleness >= 0
        told = False
        while self._newest.version < round:
            t = self._newest.version  # the next round to be trained
            done = self.trained(t)
            if done is None:
                if self._newest.version >= round - max_staleness:
                    break  # fresh enough: sample now
                if waiting is not None and not told:
                    waiting()
                    told = True
                done = self.wait(t)
            self._newest = Policy(t + 1, str(done.path))
        return self._newest

    def recorded_version(self, policy: Policy) -> int:
        """The policy version rollouts sampled from ``policy`` record (``v0`` + rounds trained)."""
        return self.start_version + policy.version

    def finish(self, rounds: int) -> tuple[Policy, TrainingResult]:
        """After the last round is handed: wait for every round's checkpoint, then the job's end (its
        ``on_end``) and its completed result; the last policy with it."""
        policy = self.policy_for(rounds, 0)
        last = int(self.checkpoint_path(rounds - 1).name.split("-")[1])
        for ckpt in self._watch:  # to the job's end (its on_end); earlier rounds' were taken from the folder
            if ckpt.step > last:
                log.warning("training job %s wrote %s after the run's last round", self.record.job_id, ckpt.path)
        return policy, self.result()
