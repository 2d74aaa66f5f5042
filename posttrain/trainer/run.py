"""``run_training``: the one entry point every launcher (CLI, submitit, Kubernetes) calls."""

from __future__ import annotations

import os
import threading

from posttrain.trainer.config import TrainerConfig, TrainingResult


def run_training(config: TrainerConfig, *, stop_event: threading.Event | None = None) -> TrainingResult:
    """Run the configured training to its end, resuming from what earlier attempts left on disk.

    Idempotent across restarts: a grpo run resumes from the last complete checkpoint in
    ``output_dir`` (and does nothing once max_steps is reached); a step run whose checkpoint
    already exists returns it; a resident run resumes after its newest checkpoint's round. Setting
    ``stop_event`` asks the run to save at the end of the current step (grpo) or to stop without a
    partial checkpoint (step, resident) and return with ``stopped_early=True``.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stop_event = stop_event or threading.Event()
    if config.mode == "grpo":
        from posttrain.trainer.grpo import run_grpo

        return run_grpo(config, stop_event)
    if config.mode == "resident":
        from posttrain.trainer.resident import run_resident

        return run_resident(config, stop_event)
    from posttrain.trainer.step import run_step

    return run_step(config, stop_event)
