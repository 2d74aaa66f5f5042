"""posttrain: nightly RL post-training (GRPO) of language models as a Prefect pipeline."""

__version__ = "0.1.0"
