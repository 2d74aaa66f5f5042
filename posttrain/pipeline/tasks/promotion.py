"""Tasks of promotion and rollback: each opens the blocks it names and calls ``posttrain.promote``."""

from __future__ import annotations

from contextlib import ExitStack

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from posttrain.datasets.staging import load_manifest, read_staged_rows
from posttrain.pipeline.settings import PromotionSettings
from posttrain.pipeline.tasks import events
from posttrain.pipeline.tasks.blocks import load_block
from posttrain.promote.promoter import Deployment, Promotion, Rollback, promote, rollback
from posttrain.publish.ledger import Ledger


def _deployment(ref: str, stack: ExitStack, completions: bool = False) -> Deployment:
    block = load_block(ref, "inference deployment")
    loader = stack.enter_context(block.hot_loader())
    return Deployment(name=block.deployment_id, loader=loader, completions=block.completions if completions else None)


@task(name="latest-snapshot", task_run_name="latest-of-{run}")
def latest_snapshot(store: str, run: str) -> str:
    """The identity of the last snapshot ``run`` published into the store."""
    with load_block(store, "store").open() as opened:
        latest, _ = Ledger(opened, run).latest()
    if latest is None:
        raise ValueError(f"candidate_run: run {run!r} has published no snapshot in store {store}")
    return latest.identity


@task(name="evaluate-and-promote", task_run_name="promote-{candidate}", cache_policy=NO_CACHE)
def evaluate_and_promote(candidate: str, run: str, promotion: PromotionSettings, reward_funcs: list[str] | None,
                         manifest: str, tokenizer: str, store: str, staging: str, production: str,
                         run_name: str | None = None) -> Promotion:
    """Evaluate ``candidate`` and production's champion on staging; promote the candidate when the gate
    accepts, under production's lease (another promotion or rollback holding it, or one that changed
    the champion during the evals: it loses, nothing changed). Not retried by Prefect: a retried flow
    run (the same ``run``) finds its decision in the history and records nothing twice. The events name
    ``run_name`` (``run`` when not given)."""
    from transformers import AutoTokenizer

    logger = get_run_logger()
    rows = read_staged_rows(manifest)
    digest = load_manifest(manifest).digest
    with ExitStack() as stack:
        opened = stack.enter_context(load_block(store, "store").open())
        done = promote(store=opened, candidate=candidate, run=run, gate=promotion.gate(),
                       settings=promotion.eval_settings(reward_funcs), rows=rows, dataset_digest=digest,
                       tokenizer=AutoTokenizer.from_pretrained(tokenizer),
                       staging=_deployment(staging, stack, completions=True),
                       production=_deployment(production, stack, completions=True), log=logger.info)
    logger.info("%s", done.decision.reason)
    events.promotion_decided(run_name or run, production, done)
    return done


@task(name="roll-back", task_run_name="rollback-to-{to}", cache_policy=NO_CACHE)
def roll_back(to: str, run: str, reason: str | None, store: str, production: str) -> Rollback:
    """Record the rollback to ``to`` and make production serve it, under production's lease; a retry of
    the flow run finds its record anywhere in the history and records nothing new."""
    logger = get_run_logger()
    with ExitStack() as stack:
        opened = stack.enter_context(load_block(store, "store").open())
        done = rollback(store=opened, production=_deployment(production, stack), to=to, run=run, reason=reason,
                        log=logger.info)
    events.rollback_done(run, production, done)
    return done
