"""``mode: resident``: one trainer job for all the rounds of a GRPO run.

The job loads the policy and its AdamW state once (``model_name_or_path``, or the newest checkpoint
of ``output_dir`` when it restarts), then, for each round r of ``rounds``, waits for the flow to
hand the round in ``rounds_dir`` (``posttrain.trainer.rounds``: ``<r:04d>/rollouts.jsonl``, then
``<r:04d>/ready.json``), takes the update a step-mode job of that round would take (the same code:
``policy.PolicyTrainer``; the same staleness rule, importance weights and metrics) and writes the same
``<output_dir>/checkpoint-<global_step>/`` atomically. Policy version ``v0 + r`` trains round r
(``v0``: the initial policy's version, 0 for a base model), so with ``num_iterations`` 1,
checkpoint N is policy version N, as in step mode.

Restarts (a Slurm requeue, a crash, a second process of a retried submission that finds nothing
running): the newest complete step checkpoint of ``output_dir`` (weights, ``optimizer.pt``,
``trainer_state.json``) is loaded and the run goes on with the round after it; a round whose
checkpoint exists is never trained again, and a run whose last round is written returns at once.
A stop request (SIGTERM, SIGUSR2) ends the wait or the update at the next optimizer step without
writing a partial checkpoint: the job exits 75 and its next start resumes. The wait for a round is
kept alive by the flow's heartbeat (``rounds.HeartbeatWatch``) while the flow publishes, hot-loads
and samples it: a round not handed ``round_timeout_s`` after the heartbeat last changed (or after
the wait began, when it never changed), that is once the flow is gone, ends the job with a
RoundError naming the round, its folder and the heartbeat's age.

Several ranks (torchrun): each polls the marker; they go on together when all see it, stop
together when any is asked to stop, and time out together. Each trains its share of the micro-batches
as in step mode; rank 0 writes the checkpoints.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from posttrain.rollouts.format import load_rollouts
from posttrain.trainer import distributed, timeline
from posttrain.trainer.checkpoints import TRAINER_STATE_FILE, CheckpointInfo, complete_checkpoints
from posttrain.trainer.config import TrainerConfig, TrainingResult
from posttrain.trainer.rounds import (
    HeartbeatWatch,
    RoundError,
    RoundReady,
    handed_rollouts,
    read_ready,
    round_dir,
)
from posttrain.trainer.policy import PolicyTrainer, select_update
from posttrain.trainer.grpo_update import OPTIMIZER_FILE, PolicyState, StepError, policy_position
from posttrain.trainer.tracking import log_update

log = logging.getLogger(__name__)

#: Seconds between two looks for a round's marker.
POLL_INTERVAL_S = 1.0


def run_resident(config: TrainerConfig, stop_event: threading.Event) -> TrainingResult:
    model_dir = Path(config.model_name_or_path)
    if not model_dir.is_dir():
        raise StepError(f"model_name_or_path {str(model_dir)!r}: resident mode needs the folder of the initial policy")
    assert config.rounds is not None and config.rounds_dir is not None  # the config validator requires them
    start_step, start_version = policy_position(model_dir)
    resume = _resume_point(config, start_step, start_version)
    done = resume[1].policy_version - start_version if resume else 0
    if done >= config.rounds:
        info, state = resume
        log.info("all %d rounds are written already; last checkpoint %s", config.rounds, info.path)
        return TrainingResult(mode="resident", global_step=state.global_step, policy_version=state.policy_version,
                              checkpoint=info.path, resumed_from=info.path, completed=True, already_done=True,
                              metrics=state.metrics, rounds_done=done)

    trainer = PolicyTrainer(config, stop_event)
    trainer.load(resume[0].path if resume else model_dir)
    if resume:
        log.info("resuming after round %d from %s", done - 1, resume[0].path)
    checkpoint = resume[0].path if resume else None
    metrics: dict[str, float] = resume[1].metrics if resume else {}

    def result(**fields) -> TrainingResult:
        return TrainingResult(mode="resident", global_step=trainer.global_step, policy_version=trainer.policy_version,
                              checkpoint=checkpoint, resumed_from=resume[0].path if resume else None,
                              metrics=metrics, rounds_done=done, **fields)

    for r in range(done, config.rounds):
        with timeline.current().span("round_wait", round=r):  # goodput: waiting on the flow is not training
            ready = wait_for_round(config, r, trainer.device, stop_event)
        if ready is None:
            log.info("stop requested while waiting for round %d", r)
            return result(completed=False, stopped_early=True)
        path = handed_rollouts(config.rounds_dir, ready)
        rollouts, sha = load_rollouts(path)
        if sha != ready.rollouts_sha256:
            raise RoundError(f"round {r}: {path} has SHA-256 {sha[:12]}, its marker hands {ready.rollouts_sha256[:12]}")
        target = config.output_dir / f"checkpoint-{trainer.global_step + config.num_iterations}"
        if target.exists():  # not the newest complete checkpoint, or it would have been resumed from
            raise StepError(f"{target}: already exists and is not a complete checkpoint of this run's round {r}")
        selection = select_update(rollouts, sha, path, trainer.policy_version, config)
        update = trainer.update(selection)
        if update is None:
            log.info("stop requested during round %d's update; nothing written for it", r)
            return result(completed=False, stopped_early=True)
        state = trainer.state(selection, update)
        trainer.save(target, state)
        if distributed.ranks().is_main:
            log_update(config, selection.version, update, model=trainer.model)
        distributed.barrier()  # every rank goes on once the checkpoint exists
        checkpoint, metrics, done = target, update, r + 1
        log.info("round %d: policy version %d at %s", r, state.policy_version, target)
    return result(completed=True)


def wait_for_round(config: TrainerConfig, round: int, device, stop_event: threading.Event) -> RoundReady | None:
    """The round's marker once every rank sees it; None when a stop request came first; RoundError
    once the flow's heartbeat has not changed for ``round_timeout_s`` (the flow is gone)."""
    assert config.rounds_dir is not None
    timeout = config.round_timeout_s
    heartbeat = HeartbeatWatch(config.rounds_dir)
    folder = round_dir(config.rounds_dir, round)
    while True:
        ready = read_ready(config.rounds_dir, round)
        age = heartbeat.age()
        missing, stop, late = distributed.any_rank_flags([ready is None, stop_event.is_set(),
                                                          ready is None and age >= timeout], device)
        if stop:
            return None
        if not missing:
            return ready
        if late:
            raise RoundError(f"round {round}: no rollouts in {folder} after {timeout:g} s without a heartbeat "
                             f"from the flow ({heartbeat.describe()})")
        stop_event.wait(max(0.0, min(POLL_INTERVAL_S, timeout - age)))


def _resume_point(config: TrainerConfig, start_step: int,
                  start_version: int) -> tuple[CheckpointInfo, PolicyState] | None:
    """The newest complete step checkpoint of output_dir (with its optimizer state), if any: the
    rounds up to it are done. StepError when it does not continue the initial policy as configured."""
    for info in reversed(complete_checkpoints(config.output_dir)):
        if not (info.path / OPTIMIZER_FILE).is_file():
            continue
        try:
            state = PolicyState.model_validate_json((info.path / TRAINER_STATE_FILE).read_bytes())
        except (OSError, ValueError):
            continue  # not a step checkpoint
        rounds = state.policy_version - start_version
        if rounds < 1 or state.global_step != start_step + rounds * config.num_iterations:
            raise StepError(
                f"{info.path}: policy version {state.policy_version} at step {state.global_step} does not continue "
                f"{config.model_name_or_path} (version {start_version}, step {start_step}) by rounds of "
                f"num_iterations={config.num_iterations}"
            )
        if rounds > config.rounds:
            raise StepError(f"{info.path}: policy version {state.policy_version} is past the run's "
                            f"{config.rounds} rounds from version {start_version}")
        return info, state
    return None
