"""The GRPO flow: each round publishes and hot-loads the current weights, samples rollout shards
from the deployment as concurrent subflows, then trains one step on the cluster. The shards run on
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

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from posttrain.datasets.staging import read_staged_rows
from posttrain.fsutil import atomic_write
from posttrain.pipeline.parameters import flat_parameters
from posttrain.pipeline.settings import GrpoSettings, flow_run_name, trainer_config
from posttrain.pipeline.tasks import events
from posttrain.pipeline.tasks.blocks import check_blocks, check_job_inputs, check_reward_funcs
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
from posttrain.pipeline.tasks.training import JOB_MARKER, ResidentJob, cancel_submitted, train_step
from posttrain.rollouts.format import load_rollouts
from posttrain.rollouts.rounds import pooled_rewards, shard_specs
from posttrain.rollouts.shard import merge_rollouts


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
@flat_parameters(GrpoSettings)
def grpo(settings: GrpoSettings) -> GrpoReport:
    """GRPO rounds: publish and hot-load the policy, sample rollout shards from it, train one step."""
    logger = get_run_logger()
    clock = FlowClock()  # the waits on publishing, hot-loads and sampling, for the goodput report
    card = settings.run_name  # artifact keys: one per run name, a version per run
    settings = settings.for_flow_run(flow_run.id)
    run_dir = settings.run_dir
    check_blocks(settings.cluster, settings.store, settings.inference)  # before anything is submitted
    check_job_inputs(settings.cluster, settings.base_model, settings.dataset, settings.shared_dir)
    check_reward_funcs(settings.rollout.reward_funcs)
    staged = stage(settings.dataset, settings.shared_dir)
    rows = read_staged_rows(staged.manifest_path)
    current = settings.base_model
    table: list[dict] = []
    resident = None
    if settings.trainer_job == "resident":  # one job for every round, submitted (or found) once
        trainer = step_trainer(settings, mode="resident", model_name_or_path=settings.base_model,
                               rounds_dir=run_dir / "rounds", rounds=settings.rounds,
                               round_timeout_s=settings.round_timeout_s)
        resident = ResidentJob(settings.cluster, settings.run_name, trainer, run_dir,
                               poll_interval=settings.watch_poll_s, card=card)
        training_metrics(card, trainer)  # where the curves are: TensorBoard's folder and command
    # The shards' task runner (docs/prefect.md): the flow's own (threads), or Dask's for the run's rounds.
    with shard_runner(settings.task_runner, settings.dask_address, settings.dask_workers) as runner:
        for r in range(settings.rounds):
            t0 = time.perf_counter()
            if resident is not None and (resident.trained(r) or resident.sampled(r)):
                # A retried flow run: the round was sampled (and maybe trained) by an earlier attempt.
                current = resume_round(resident, r, table, logger, t0)
                round_table(card, table, resident.trainer)
                continue
            with clock.wait("publish"):
                snapshot = publish_weights(current, r, settings)
            t_pub = time.perf_counter() - t0
            with clock.wait("hot-load"):
                loaded = hot_load(snapshot, settings) if settings.inference else None
            t_load = time.perf_counter() - t0 - t_pub
            round_dir = run_dir / "rounds" / f"{r:04d}"
            # The shards check that every reply comes from this snapshot: what was hot-loaded (a full
            # snapshot when a delta fell back), else what was published.
            identity = loaded.identity if loaded else snapshot.identity
            specs = shard_specs(rows, round=r, per_round=settings.prompts_per_round, shards=settings.shards,
                                policy_version=r, round_dir=round_dir, identity=identity)
            tokenizer_dir = settings.base_model if settings.lora.use_lora else current  # LoRA keeps the tokenizer
            with clock.wait("sampling"):
                shards = map_shards(runner, specs, settings.rollout, settings.inference, tokenizer_dir).result()
                rollouts = merge_rollouts([s.path for s in shards], round_dir / "rollouts.jsonl")
            n, mean, std, spread = pooled_rewards(shards)
            if resident is not None:
                resident.hand(r, r)
                current = str(resident.wait(r).path)
                trainer = resident.trainer
                logger.info("round %d: trained by the resident job at %s", r, current)
            else:
                trainer = step_trainer(settings, mode="step", model_name_or_path=current, rollouts=rollouts)
                if r == 0:
                    training_metrics(card, trainer)  # where the curves are: TensorBoard's folder and command
                current = train_step(settings.cluster, settings.run_name, r, trainer, str(round_dir / "train-job.json"),
                                     card=card)
            table.append({
                "round": r, "policy version": r, "samples": n, "reward mean": round(mean, 4),
                "reward std": round(std, 4), "shard spread": round(spread, 4), "snapshot": snapshot.identity,
                "kind": snapshot.kind, "delta % of full": size_column(snapshot),
                "publish s": round(t_pub, 2), "hot-load s": round(t_load, 2) if loaded else None,
                "round s": round(time.perf_counter() - t0, 2),
            })
            round_table(card, table, trainer)
            events.round_finished(settings.run_name, r, n, mean, std, identity)
            reward_curve(card, [row["reward mean"] for row in table], [row["reward std"] for row in table])
            logger.info("round %d: reward %.3f over %d samples; next policy %s", r, mean, n, current)
    if resident is not None:
        resident.finish()  # the job's end: it completed after the last round, or the run fails with its reason
    with clock.wait("publish"):
        final = publish_weights(current, settings.rounds, settings)
    if settings.inference:
        with clock.wait("hot-load"):
            hot_load(final, settings)
    svg = reward_curve_svg([row["reward mean"] for row in table], [row["reward std"] for row in table])
    curve = atomic_write(run_dir / "reward-curve.svg", svg)
    jobs = [run_dir / JOB_MARKER] if resident is not None else sorted(run_dir.glob("rounds/*/train-job.json"))
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


def resume_round(resident: ResidentJob, r: int, table: list[dict], logger, t0: float) -> str:
    """A round an earlier attempt of the flow run sampled: hand it again unless it trained, wait for
    its checkpoint, add its row (its rewards read back from its rollouts); the round's policy."""
    done = resident.trained(r)
    if done is None:
        logger.info("round %d: rollouts written by an earlier attempt; handing them again", r)
        resident.hand(r, r)
        done = resident.wait(r)
    else:
        logger.info("round %d: trained by an earlier attempt (%s); not sampled again", r, done.path)
    folder = resident.rounds_dir / f"{r:04d}"
    rollouts = load_rollouts(folder / "rollouts.jsonl")[0] if resident.sampled(r) else []
    rewards = [x.reward for x in rollouts]
    identity = next((x.snapshot_identity for x in rollouts if x.snapshot_identity), "")  # what sampled them
    n = len(rewards)
    mean = sum(rewards) / n if n else 0.0
    std = (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5 if n else 0.0
    table.append({"round": r, "policy version": r, "samples": n, "reward mean": round(mean, 4),
                  "reward std": round(std, 4), "shard spread": None, "snapshot": identity, "kind": None,
                  "delta % of full": None, "publish s": None, "hot-load s": None,
                  "round s": round(time.perf_counter() - t0, 2), "resumed": True})
    return str(done.path)
