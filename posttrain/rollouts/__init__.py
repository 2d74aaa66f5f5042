"""GRPO rollouts sampled from an inference deployment: client, shards, scoring."""
