"""``TrainingJob``: run_training as a submitit job that can be requeued on timeout or preemption."""

from __future__ import annotations

import threading
from typing import Any

import submitit
from submitit.helpers import DelayedSubmission

from posttrain.trainer.config import TrainerConfig, TrainingResult
from posttrain.trainer.run import run_training


class TrainingJob(submitit.helpers.Checkpointable):
    """Submit ``TrainingJob()`` with a TrainerConfig; submitit requeues it on SIGUSR2 (timeout, preemption).

    Training runs in a worker thread so that the main thread, where submitit's signal handler
    calls ``checkpoint()``, can ask it to save at the end of the current step and wait up to
    ``grace_period_s`` for that save. The requeued job resumes from the checkpoints on disk.
    """

    def __init__(self, grace_period_s: float = 120.0):
        self.grace_period_s = grace_period_s
        self._stop: threading.Event | None = None
        self._worker: threading.Thread | None = None

    def __call__(self, config: TrainerConfig | dict[str, Any]) -> TrainingResult:
        config = TrainerConfig.model_validate(config)
        outcome: dict[str, Any] = {}
        stop = threading.Event()

        def work() -> None:
            try:
                outcome["result"] = run_training(config, stop_event=stop)
            except BaseException as e:  # re-raised in the calling thread
                outcome["error"] = e

        # A daemon thread, so that submitit's exit after a requeue is not held up by a slow save.
        worker = threading.Thread(target=work, name="posttrain-training", daemon=True)
        worker.start()
        self._stop, self._worker = stop, worker
        try:
            while worker.is_alive():
                worker.join(timeout=0.5)  # short waits keep signal handlers responsive
        finally:
            self._stop = self._worker = None
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """Ask the running training to save now, wait for it (bounded), and resubmit this job."""
        stop, worker = self._stop, self._worker
        if stop is not None and worker is not None:
            stop.set()
            worker.join(timeout=self.grace_period_s)
        return DelayedSubmission(self, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # Threads and events cannot be pickled; a resubmitted job starts without them.
        return {"grace_period_s": self.grace_period_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)
