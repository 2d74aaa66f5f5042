"""The trainer that runs on cluster nodes: ``python -m posttrain.trainer CONFIG.yaml``.

``run_training(config)`` is idempotent across restarts: a GRPO run (``trainer/grpo.py``, TRL)
resumes from the last complete checkpoint (``trainer/checkpoints.py``); a step run
(``trainer/step.py``) trains one GRPO step on rollouts sampled elsewhere; a resident run
(``trainer/resident.py``) trains every round of a GRPO run in one job, rounds handed on shared
storage (``trainer/rounds.py``). Importing this package
loads no torch; a run imports it when it starts.
"""

from posttrain.trainer.config import ConfigError, TrainerConfig, TrainingResult, load_trainer_config
from posttrain.trainer.run import run_training

__all__ = ["ConfigError", "TrainerConfig", "TrainingResult", "load_trainer_config", "run_training"]
