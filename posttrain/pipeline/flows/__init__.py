"""Prefect flows: the nightly post-training run and GRPO rounds with rollouts from a deployment."""
