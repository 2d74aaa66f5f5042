"""The trainer that runs on cluster nodes: ``python -m posttrain.trainer CONFIG.yaml``.

``run_training(config)`` is idempotent across restarts; ``TrainingJob`` wraps it for submitit.
Importing this package loads no torch; a run imports it when it starts.
"""

from posttrain.trainer.config import ConfigError, TrainerConfig, TrainingResult, load_trainer_config
from posttrain.trainer.job import TrainingJob
from posttrain.trainer.run import run_training

__all__ = ["ConfigError", "TrainerConfig", "TrainingJob", "TrainingResult", "load_trainer_config", "run_training"]
