"""The GRPO flow: each round publishes and hot-loads the current weights, samples rollout shards
from the deployment as concurrent tasks (``rollout-shard``), then trains one step on the cluster. The shards run on
the flow's own task runner (threads in its process) or, with ``task_runner: dask``, on a Dask
cluster (``shard_runner``; docs/prefect.md).

Training (``trainer_job``): ``resident`` (the default) submits one trainer job for the whole run
(``mode: resident``), which loads the policy and its optimizer once; each round's rollouts are handed
to it in the round's folder and the flow waits for the round's checkpoint with the run's checkpoint
watch. ``per_round`` submits a step job per round (``mode: step``). A retried flow run finds the
resident job (its submit marker) and goes on from the rounds it trained: a round whose checkpoint
exists is not sampled again; one whose rollouts were written is handed again, not sampled again.

Every rollout of round r carries policy version r and the snapshot identity hot-loaded for the
round; a shard whose replies come from any other snapshot fails (``SnapshotMismatch``).

With ``use_lora``, each round's step trains the same adapter further (from the base in round 0)
and the policy published is the base with the adapter merged into it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from posttrain.datasets.staging import read_staged_rows
from posttrain.fsutil import atomic_write
from posttrain.pipeline.parameters import flat_parameters
from posttrain.pipeline.settings import GrpoSettings, flow_run_name, trainer_config
from posttrain.pipeline.tasks import events
from posttrain.pipeline.tasks.blocks import check_blocks, check_dask_scheduler, check_job_inputs, check_reward_funcs
from posttrain.pipeline.tasks.goodput import FlowClock, report_goodput
from posttrain.pipeline.tasks.publishing import hot_load, publish_weights
from posttrain.pipeline.tasks.report import (
    reward_curve,
    reward_curve_svg,
    round_table,
    size_column,
    training_metrics,
)
from posttrain.pipeline.tasks.rollouts import map_shards, shard_runner
from posttrain.pipeline.tasks.staging import stage
from posttrain.pipeline.tasks.training import (
    cancel_submitted,
    resident_markers,
    resident_run,
    stops_jobs_when_cancelled,
    train_step,
)
from posttrain.publish.publisher import PublishedSnapshot
from posttrain.rollouts.format import load_rollouts
from posttrain.rollouts.rounds import pooled_rewards, shard_specs
from posttrain.rollouts.shard import merge_rollouts
from posttrain.runs.resident import ResidentRun
from posttrain.trainer.rounds import start_position


class GrpoReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_name: str
    rounds: list[dict]
    final_checkpoint: str
    final_snapshot: str
    reward_curve: str
    run_dir: str
    tensorboard_dir: str | None = None


@flow(name="grpo", flow_run_name=flow_run_name, log_prints=True,
      on_cancellation=[cancel_submitted(GrpoSettings)],
      on_crashed=[cancel_submitted(GrpoSettings)])
@stops_jobs_when_cancelled(GrpoSettings)  # at once; the hooks come 15-20 s later
@flat_parameters(GrpoSettings)
def grpo(settings: GrpoSettings) -> GrpoReport:
    """GRPO rounds: publish and hot-load the policy, sample rollout shards from it, train one step."""
    logger = get_run_logger()
    clock = FlowClock()  # the waits on publishing, hot-loads and sampling, for the goodput report
    card = settings.run_name  # artifact keys: one per run name, a version per run
    settings = settings.for_flow_run(flow_run.id)
    run_dir = settings.run_dir
    check_blocks(settings.cluster, settings.store, settings.inference)  # before anything is submitted
    check_job_inputs(settings.cluster, settings.base_model, settings.dataset, settings.shared_dir,
                     ref_model=settings.ref_model)
    if settings.dask_address:  # before the job is submitted, not at the first round's shards
        check_dask_scheduler(settings.dask_address)
    check_reward_funcs(settings.rollout.reward_funcs)
    staged = stage(settings.dataset, settings.shared_dir)
    rows = read_staged_rows(staged.manifest_path)
    table: list[dict] = []
    if settings.trainer_job == "resident":
        current = resident_rounds(settings, rows, clock, table, card)
    else:
        current = per_round_jobs(settings, rows, clock, table, card)
    with clock.wait("publish"):
        final = publish_weights(current, settings.rounds, settings)
    if settings.inference:
        with clock.wait("hot-load"):
            hot_load(final, settings)
    svg = reward_curve_svg([row["reward mean"] for row in table], [row["reward std"] for row in table],
                           max_points=max(len(table), 1))  # the run folder's curve: every round
    curve = atomic_write(run_dir / "reward-curve.svg", svg)
    resident = settings.trainer_job == "resident"
    jobs = resident_markers(run_dir) if resident else sorted(run_dir.glob("rounds/*/train-job.json"))
    report_goodput(card, settings.run_name, clock, jobs)
    return GrpoReport(run_name=settings.run_name, rounds=table, final_checkpoint=current,
                      final_snapshot=final.identity, reward_curve=str(curve), run_dir=str(run_dir),
                      tensorboard_dir=str(run_dir / "tensorboard") if "tensorboard" in settings.trainer.report_to
                      else None)


def step_trainer(settings: GrpoSettings, **filled):
    """The trainer config of the run's step job (``mode: step``) or resident job (``mode: resident``):
    the flow's trainer settings, sampled at the rollouts' temperature, checkpoints in the run's policy folder."""
    run_dir = settings.run_dir
    return trainer_config(settings.trainer, settings.lora, output_dir=run_dir / "policy",
                          temperature=settings.rollout.temperature, logging_dir=run_dir / "tensorboard",
                          run_name=settings.run_name, **filled)


@dataclass(frozen=True)
class Served:
    """What the deployment serves for the rounds: the snapshot published of policy ``step``, the
    identity hot-loaded (a full snapshot when a delta fell back), and the seconds each took (None for
    rounds that reuse it)."""

    step: int
    snapshot: PublishedSnapshot
    identity: str
    publish_s: float | None = None
    hotload_s: float | None = None


def serve_policy(settings: GrpoSettings, policy: str, step: int, clock: FlowClock, served: Served | None) -> Served:
    """Publish ``policy`` as ``step`` and hot-load it, unless ``served`` is that step already (asynchronous
    rounds sample several rounds from one policy: published and hot-loaded once)."""
    if served is not None and served.step == step:
        return Served(step, served.snapshot, served.identity)
    t0 = time.perf_counter()
    with clock.wait("publish"):
        snapshot = publish_weights(policy, step, settings)
    t1 = time.perf_counter()
    with clock.wait("hot-load"):
        loaded = hot_load(snapshot, settings)
    return Served(step, snapshot, loaded.identity, round(t1 - t0, 2), round(time.perf_counter() - t1, 2))


def sample_round(settings: GrpoSettings, runner, rows: list[dict], r: int, tokenizer_dir: str, version: int,
                 served: Served, clock: FlowClock) -> tuple[dict, str]:
    """Sample round ``r`` from what the deployment serves (``served``), its rollouts recorded as policy
    ``version``; (the round's table row, its merged rollouts file)."""
    round_dir = settings.run_dir / "rounds" / f"{r:04d}"
    # The shards check that every reply comes from the served snapshot; no hot-load happens while a
    # round samples, so each shard's replies come from the one snapshot it names.
    specs = shard_specs(rows, round=r, per_round=settings.prompts_per_round, shards=settings.shards,
                        policy_version=version, round_dir=round_dir, identity=served.identity)
    if settings.lora.use_lora:
        tokenizer_dir = settings.base_model  # LoRA keeps the base's tokenizer
    t0 = time.perf_counter()
    with clock.wait("sampling"):
        shards = map_shards(runner, specs, settings.rollout, settings.inference, tokenizer_dir).result()
        rollouts = merge_rollouts([s.path for s in shards], round_dir / "rollouts.jsonl")
    n, mean, std, spread = pooled_rewards(shards)
    events.round_finished(settings.run_name, r, n, mean, std, served.identity)
    row = {"round": r, "policy version": version, "samples": n, "reward mean": round(mean, 4),
           "reward std": round(std, 4), "shard spread": round(spread, 4), "snapshot": served.snapshot.identity,
           "kind": served.snapshot.kind, "delta % of full": size_column(served.snapshot),
           "publish s": served.publish_s, "hot-load s": served.hotload_s, "sample s": round(time.perf_counter() - t0, 2)}
    return row, rollouts


def per_round_jobs(settings: GrpoSettings, rows: list[dict], clock: FlowClock, table: list[dict], card: str) -> str:
    """``trainer_job: per_round``: sample a round, train it in a step job of its own, and so on; the last policy."""
    logger = get_run_logger()
    current, v0 = settings.base_model, start_position(settings.base_model)[1]
    with shard_runner(settings.task_runner, settings.dask_address, settings.dask_workers) as runner:
        for r in range(settings.rounds):
            t0 = time.perf_counter()
            served = serve_policy(settings, current, r, clock, None)
            row, rollouts = sample_round(settings, runner, rows, r, current, v0 + r, served, clock)
            trainer = step_trainer(settings, mode="step", model_name_or_path=current, rollouts=rollouts,
                                   max_staleness=0)
            if r == 0:
                training_metrics(card, trainer)  # where the curves are: TensorBoard's folder and command
            current = train_step(settings.cluster, settings.run_name, r, trainer,
                                 str(settings.run_dir / "rounds" / f"{r:04d}" / "train-job.json"), card=card)
            table.append(row | {"round s": round(time.perf_counter() - t0, 2)})
            round_table(card, table, trainer)
            reward_curve(card, [x["reward mean"] for x in table], [x["reward std"] for x in table], settings.rounds)
            logger.info("round %d: reward %.3f; next policy %s", r, row["reward mean"], current)
        if table:  # the live table showed the latest rounds: every round, once
            round_table(card, table, trainer, whole=True)
    return current


def resident_rounds(settings: GrpoSettings, rows: list[dict], clock: FlowClock, table: list[dict], card: str) -> str:
    """``trainer_job: resident``: one job trains every round (``posttrain.runs.resident``). Round r is
    sampled from the newest policy at most ``max_staleness`` versions behind it (waiting for the
    trainer at the bound), then handed to the job; the last policy. A retried flow run hands again
    the rounds an earlier attempt sampled (their rollouts are not sampled again)."""
    logger = get_run_logger()
    k = settings.max_staleness
    trainer = step_trainer(settings, mode="resident", model_name_or_path=settings.base_model,
                           rounds_dir=settings.run_dir / "rounds", rounds=settings.rounds,
                           round_timeout_s=settings.round_timeout_s, max_staleness=k)
    job = resident_run(settings.cluster, settings.run_name, trainer, settings.run_dir,
                       poll_interval=settings.watch_poll_s, card=card)
    training_metrics(card, trainer)  # where the curves are: TensorBoard's folder and command
    served: Served | None = None
    # The heartbeat keeps the trainer's wait for a round alive while this flow publishes, hot-loads
    # and samples it (round_timeout_s counts from the last beat); after the last hand-over it waits for no round.
    with job.keep_alive(), shard_runner(settings.task_runner, settings.dask_address, settings.dask_workers) as runner:
        for r in range(settings.rounds):
            t0 = time.perf_counter()
            if job.sampled(r):  # a retried flow run: an earlier attempt sampled it (and maybe it trained)
                logger.info("round %d: sampled by an earlier attempt; handed again, not sampled again", r)
                row, versions = resumed_row(job, r)
                job.hand(r, versions)
                table.append(row)
                continue
            policy = job.policy_for(r, k, waiting=lambda r=r: logger.info(  # the job's timeline counts this time
                "round %d: waiting for the trainer (max_staleness %d)", r, k))
            t_wait = time.perf_counter() - t0
            served = serve_policy(settings, policy.path, policy.version, clock, served)
            row, _ = sample_round(settings, runner, rows, r, policy.path, job.recorded_version(policy), served, clock)
            job.hand(r, job.recorded_version(policy))
            table.append(row | {"staleness": r - policy.version, "wait s": round(t_wait, 2),
                                "round s": round(time.perf_counter() - t0, 2)})
            round_table(card, table, trainer, asynchronous=k > 0)
            reward_curve(card, [x["reward mean"] for x in table], [x["reward std"] for x in table], settings.rounds)
            logger.info("round %d: reward %.3f, sampled from policy version %d; handed to the trainer", r,
                        row["reward mean"], job.recorded_version(policy))
    if table:  # the live table showed the latest rounds: every round, once
        round_table(card, table, trainer, asynchronous=k > 0, whole=True)
    last, _ = job.finish(settings.rounds)  # every round's checkpoint, then the job's end (or its reason)
    return last.path


def resumed_row(job: ResidentRun, r: int) -> tuple[dict, list[int]]:
    """The table row of a round an earlier attempt sampled, its rewards and snapshot read back from its
    rollouts; and the policy versions that sampled them."""
    rollouts = load_rollouts(job.rounds_dir / f"{r:04d}" / "rollouts.jsonl")[0]
    rewards = [x.reward for x in rollouts]
    n = len(rewards)
    mean = sum(rewards) / n if n else 0.0
    std = (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5 if n else 0.0
    identity = next((x.snapshot_identity for x in rollouts if x.snapshot_identity), "")
    versions = sorted({x.policy_version for x in rollouts}) or [job.start_version + r]
    return ({"round": r, "policy version": versions[0], "samples": n, "reward mean": round(mean, 4),
             "reward std": round(std, 4), "shard spread": None, "snapshot": identity, "resumed": True}, versions)
