"""Rollout shards: each samples from the deployment, scores, and writes rollouts."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.tasks import exponential_backoff

from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.retry import transient_only
from posttrain.rollouts.shard import RolloutSettings, ShardResult, ShardSpec, run_shard


@task(name="sample-and-score", task_run_name="sample-r{spec.round}-s{spec.shard}")
def sample_and_score(spec: ShardSpec, settings: RolloutSettings, inference: str, tokenizer_dir: str) -> ShardResult:
    from transformers import AutoTokenizer

    deployment = load_block(inference, "inference")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    client = deployment.completions()
    try:
        result = run_shard(spec, settings, client, tokenizer)
    finally:
        client.close()
    get_run_logger().info("shard %d of round %d: %d samples, reward %.3f ± %.3f (policy v%d, snapshot %s)",
                          spec.shard, spec.round, result.samples, result.reward_mean, result.reward_std,
                          result.policy_version, result.snapshot_identity or "unknown")
    return result


@flow(name="rollout-shard", flow_run_name="round-{spec.round}-shard-{spec.shard}")
def rollout_shard(spec: ShardSpec, settings: RolloutSettings, inference: str, tokenizer_dir: str) -> ShardResult:
    """One shard of a round: sample num_generations completions per prompt, score them."""
    return sample_and_score(spec, settings, inference, tokenizer_dir)


# A task around the subflow: .map() runs the round's shards concurrently, and a failing shard is
# retried alone (its task re-runs only its own subflow).
rollout_shard_task = task(
    rollout_shard, name="rollout-shard", retries=2, retry_delay_seconds=exponential_backoff(1),
    retry_condition_fn=transient_only, task_run_name="shard-{spec.shard}",
)
