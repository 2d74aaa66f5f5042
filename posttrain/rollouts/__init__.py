"""GRPO rollouts: what the trainer's step trains on, and how a round samples and scores them.

- ``format``: the rollout JSONL file (token ids, behaviour logprobs, reward, group, policy version);
- ``scoring``: reward functions loaded by import path, weighted sums, group advantages;
- ``client``: the ``/v1/completions`` client of an inference deployment;
- ``shard``: one shard of a round (sample, score, write) and merging shards;
- ``rounds``: a round's prompts, its shards, and the pooled reward statistics.

No torch and no Prefect.
"""
