"""Retention across runs as a flow's last task: ``posttrain gc`` on the run's store block
(docs/retention.md, "From the nightly flow").

gc keeps the newest ``gc_keep_runs`` runs (or those published within ``gc_keep_days``) whole, what
every promotion history in the store needs (the engine reads them), the identities given, and
what the inference deployments named serve now (their replicas, ``served_identities``). It
deletes nothing when it cannot learn what a deployment serves, or cannot read a history: the
task fails, naming why."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from posttrain.pipeline.settings import GcSettings
from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.report import gc_table
from posttrain.pipeline.tasks.retry import transient_only
from posttrain.publish.gc import GcConfig, GcPlan, GcResult, plan_gc, run_gc
from posttrain.words import plural


def served_roots(inference: list[str]) -> dict[str, str]:
    """identity -> "served by <block>" for what each inference deployment block's replicas serve now."""
    roots: dict[str, set[str]] = {}
    for ref in inference:
        with load_block(ref, "inference").hot_loader() as loader:
            for identity in loader.served_identities():
                roots.setdefault(identity, set()).add(f"served by {ref}")
    return {i: "; ".join(sorted(why)) for i, why in roots.items()}


def summary(plan: GcPlan, result: GcResult) -> dict:
    """What the task returns (JSON-compatible)."""
    return {"store": plan.store, "runs": len(plan.runs), "kept_runs": [r.run for r in plan.runs if r.kept],
            "protected": plan.held_back(), "deleted": len(result.deleted), "freed_bytes": result.freed_bytes,
            "skipped": dict(result.skipped)}


@task(name="collect-garbage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(5),
      retry_condition_fn=transient_only)
def collect_garbage(store_ref: str, gc: GcSettings, protect: list[str], *, inference: list[str] | None = None,
                    card: str | None = None) -> dict:
    """Delete the snapshots of old runs of the store block ``store_ref`` that no kept or protected
    version needs; ``protect`` (with ``gc.gc_protect``) and what the ``inference`` blocks serve are
    protected besides the promotion histories. Writes a table artifact of what was deleted (key
    ``<card>-gc``) and returns ``summary``."""
    logger = get_run_logger()
    config = GcConfig(keep_runs=gc.gc_keep_runs, keep_days=gc.gc_keep_days, protect={*gc.gc_protect, *protect})
    roots = served_roots(inference or [])
    store = load_block(store_ref, "store").open()
    try:
        plan = plan_gc(store, config, roots=roots)
        for identity, why in plan.held_back().items():
            logger.info("gc keeps %s with its chain prefix: %s", identity, why)
        for identity, why in plan.absent.items():
            logger.info("gc: %s (%s) is not in the store; nothing to keep", identity, why)
        result = run_gc(store, plan)
    finally:
        store.close()
    for why in result.skipped.values():
        logger.warning("gc skipped %s", why)
    kept = [r.run for r in plan.runs if r.kept]
    logger.info("gc of %s: %s, kept whole: %s; deleted %s, freed %d bytes", plan.store, plural(len(plan.runs), "run"),
                ", ".join(kept) or "(none)", plural(len(result.deleted), "snapshot"), result.freed_bytes)
    rows = [{"run": d.run, "identity": d.identity, "kind": d.kind, "step": d.step, "bytes": d.bytes}
            for d in result.deleted]
    gc_table(card or store_ref, rows, f"gc of {plan.store}: {plural(len(rows), 'snapshot')} deleted, "
             f"{result.freed_bytes} bytes "
             f"freed; runs kept whole: {', '.join(kept) or '(none)'}; skipped: {', '.join(result.skipped) or 'none'}")
    return summary(plan, result)
