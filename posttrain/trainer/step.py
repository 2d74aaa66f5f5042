"""``mode: step``: one GRPO update of the current policy on rollouts sampled elsewhere.

Reads the policy folder (``model_name_or_path``) and the rollouts file, drops rollouts older than
``max_staleness`` versions, computes group advantages, and takes ``num_iterations`` optimizer
steps of the clipped objective with truncated importance sampling (the sampler's policy may be
one version stale, or numerically different). The result is written atomically as
``<output_dir>/checkpoint-<step>/``: weights (safetensors), config, tokenizer files,
``optimizer.pt`` (AdamW moments carry over to the next step) and ``trainer_state.json``
(a ``PolicyState``). Re-running the same step finds its checkpoint and does nothing.
The update's metrics also go to the ``report_to`` trackers (``posttrain.trainer.tracking``): one
point per update at step = the policy version trained from, so the rounds of a run draw one curve.

A step is ``trainer/policy.py``'s ``PolicyTrainer``: ``load`` + one ``update`` + ``save``, the code
``mode: resident`` shares (load once, then an update and a save per round), so both write the same
checkpoints from the same rollouts; its pieces are in ``trainer/grpo_update.py``.

Launched as several processes (torchrun, one node or many), each rank takes every world_size-th
micro-batch and the gradients are summed over ranks before clipping: the same update as one
process (the loss is normalized by the whole batch's tokens or sequences). Rank 0 alone writes.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from posttrain.rollouts.format import load_rollouts
from posttrain.trainer import distributed
from posttrain.trainer.checkpoints import TRAINER_STATE_FILE, IncompleteCheckpoint, inspect_checkpoint
from posttrain.trainer.config import TrainerConfig, TrainingResult
from posttrain.trainer.grpo_update import PolicyState, StepError, policy_position
from posttrain.trainer.policy import PolicyTrainer, select_update
from posttrain.trainer.tracking import log_update

log = logging.getLogger(__name__)


def run_step(config: TrainerConfig, stop_event: threading.Event) -> TrainingResult:
    model_dir = Path(config.model_name_or_path)
    if not model_dir.is_dir():
        raise StepError(f"model_name_or_path {str(model_dir)!r}: step mode needs the folder of the current policy")
    assert config.rollouts is not None  # the config validator requires it in step mode
    start_step, version = policy_position(model_dir)
    rollouts, rollouts_sha = load_rollouts(config.rollouts)
    new_step = start_step + config.num_iterations
    target = config.output_dir / f"checkpoint-{new_step}"
    finished = _already_written(target, model_dir, rollouts_sha)
    if finished is not None:
        return finished

    selection = select_update(rollouts, rollouts_sha, config.rollouts, version, config)
    trainer = PolicyTrainer(config, stop_event)
    trainer.load(model_dir)
    metrics = trainer.update(selection)
    if metrics is None:
        return TrainingResult(mode="step", global_step=start_step, completed=False, stopped_early=True, checkpoint=None)
    state = trainer.state(selection, metrics)
    trainer.save(target, state)
    if distributed.ranks().is_main:
        # after the save: a retry of a step that is written finds it and logs no second point
        log_update(config, version, metrics, model=trainer.model)
    distributed.barrier()  # every rank returns once the checkpoint exists
    return TrainingResult(
        mode="step",
        global_step=new_step,
        policy_version=state.policy_version,
        checkpoint=target,
        completed=True,
        metrics=metrics,
    )


def _already_written(target: Path, model_dir: Path, rollouts_sha: str) -> TrainingResult | None:
    """The result of an earlier attempt of this very step, or None; StepError if target holds another."""
    if not target.exists():
        return None
    try:
        inspect_checkpoint(target)
        state = PolicyState.model_validate_json((target / TRAINER_STATE_FILE).read_bytes())
    except (IncompleteCheckpoint, ValueError) as e:
        raise StepError(f"{target}: already exists and is not a complete step checkpoint ({e})") from None
    if state.source_checkpoint != str(model_dir) or state.rollouts_sha256 != rollouts_sha:
        raise StepError(
            f"{target}: already holds a step from {state.source_checkpoint} on rollouts "
            f"{state.rollouts_sha256[:12]}, not from {model_dir} on rollouts {rollouts_sha[:12]}"
        )
    log.info("step already written by an earlier attempt: %s", target)
    return TrainingResult(
        mode="step",
        global_step=state.global_step,
        policy_version=state.policy_version,
        checkpoint=target,
        completed=True,
        already_done=True,
        metrics=state.metrics,
    )
