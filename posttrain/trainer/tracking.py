"""Training metrics where ML users look: TRL's ``report_to`` trackers, in both modes.

TensorBoard is the default and needs no account: its event files go to the config's
``tensorboard_dir`` (``logging_dir``, else ``tensorboard/`` beside ``output_dir``: in the flows,
``<run dir>/tensorboard``), one folder per run whatever the number of jobs. Each process that
writes adds its own ``events.out.tfevents.*`` file there and TensorBoard shows them as one run.

- ``mode: grpo``: TRL logs every ``logging_steps`` optimizer steps through transformers' callbacks
  (``train/loss``, ``train/reward``, ``train/grad_norm``, ...). For TensorBoard the callback gets a
  writer on ``tensorboard_dir`` (transformers would pick ``output_dir/runs/<date_host>`` instead);
  the other trackers are passed to TRL as they are, with ``run_name``.
- ``mode: step``: one process per update (a GRPO round), so :func:`log_update` writes one point
  per update, at step = the policy version trained from (round r trains version r), and the
  successive processes extend the same curves. TensorBoard is written here; the other trackers go
  through transformers' integration callbacks (begin, one log, end per process: wandb, for one,
  makes one run per round unless ``WANDB_RUN_ID`` and ``WANDB_RESUME=allow`` name one). A tracker
  that fails is logged as a warning and never fails the step: the metrics are in the checkpoint's
  ``trainer_state.json`` too.
- ``mode: resident``: the same one point per update (round), from the one process of the run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain.trainer.config import TrainerConfig

log = logging.getLogger(__name__)

#: Step-mode metric names that have a TRL counterpart in grpo mode, so both modes draw the same curves.
TRL_NAMES = {"mean_reward": "reward"}
TENSORBOARD = "tensorboard"


def tensorboard_writer(log_dir: Path):
    """A TensorBoard ``SummaryWriter`` on ``log_dir`` (created): torch's, else tensorboardX's."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's needs the tensorboard package; tensorboardX is the alternative
        from tensorboardX import SummaryWriter
    log_dir.mkdir(parents=True, exist_ok=True)
    return SummaryWriter(log_dir=str(log_dir))


def grpo_reporting(config: TrainerConfig, is_main: bool) -> tuple[list[str], list]:
    """For TRL (grpo mode): the ``report_to`` to give GRPOConfig and the callbacks to add.

    TensorBoard is taken out of ``report_to`` and added as transformers' own callback with a writer on
    ``tensorboard_dir`` (on the main process only: the callback writes nothing on the others)."""
    trackers = config.trackers
    report_to = [t for t in trackers if t != TENSORBOARD] or ["none"]
    callbacks = []
    if TENSORBOARD in trackers and is_main:
        from transformers.integrations import TensorBoardCallback

        callbacks.append(TensorBoardCallback(tb_writer=tensorboard_writer(config.tensorboard_dir)))
    return report_to, callbacks


def update_logs(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics under TRL's names where it has them (``mean_reward`` is ``reward``)."""
    return {TRL_NAMES.get(k, k): float(v) for k, v in metrics.items()}


def log_update(config: TrainerConfig, step: int, metrics: dict[str, float], model=None) -> None:
    """Step mode: the update's metrics as one point at ``step`` in every tracker of ``report_to``.

    TensorBoard gets ``train/<name>`` scalars (transformers' names); the others, transformers'
    integration callbacks. Never raises: a tracker that fails is a warning."""
    logs = update_logs(metrics)
    trackers = config.trackers
    if TENSORBOARD in trackers:
        try:
            writer = tensorboard_writer(config.tensorboard_dir)
            try:
                for name, value in logs.items():
                    writer.add_scalar(f"train/{name}", value, step)
            finally:
                writer.close()
        except Exception as e:  # noqa: BLE001 - the metrics are in trainer_state.json too
            log.warning("tensorboard: could not write the update's metrics to %s: %s", config.tensorboard_dir, e)
    others = [t for t in trackers if t != TENSORBOARD]
    if others:
        _log_with_integrations(config, others, step, logs, model)


def _log_with_integrations(config: TrainerConfig, trackers: list[str], step: int, logs: dict[str, float],
                           model) -> None:
    """One point at ``step`` through transformers' integration callbacks (wandb, mlflow, trackio, ...)."""
    try:
        from transformers import TrainerControl, TrainerState, TrainingArguments
        from transformers.integrations import get_reporting_integration_callbacks

        classes = get_reporting_integration_callbacks(trackers)
        args = TrainingArguments(output_dir=str(config.output_dir), report_to=trackers, run_name=config.run_name,
                                 use_cpu=True, logging_steps=1, max_steps=step + 1)
        state = TrainerState(global_step=step, max_steps=step + 1, is_world_process_zero=True,
                             is_local_process_zero=True)
    except Exception as e:  # noqa: BLE001
        log.warning("report_to %s: not logged in step mode: %s", trackers, e)
        return
    for cls in classes:
        control = TrainerControl()
        try:
            callback = cls()
            callback.on_train_begin(args, state, control, model=model)
            callback.on_log(args, state, control, model=model, logs=dict(logs))
            callback.on_train_end(args, state, control, model=model)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not log the update's metrics: %s", cls.__name__, e)
