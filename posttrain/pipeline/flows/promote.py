"""The promote and rollback flows: a snapshot reaches production only when the eval gate says it is
better than the champion, and production can serve any earlier version again (docs/promotion.md).

``promote`` runs alone (its deployment, the CLI, the UI) and as the nightly flow's last step
(``promote_to``). ``rollback`` makes production serve ``previous`` or any identity of the store.
Whichever starts them, they decide, record and switch production under its lease, one at a time
with ``posttrain rollback`` too (docs/promotion.md, "One writer per deployment")."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from posttrain.pipeline.parameters import flat_parameters
from posttrain.pipeline.promotion_settings import PromoteSettings, RollbackSettings
from posttrain.pipeline.settings import renamed, run_suffix
from posttrain.pipeline.tasks.blocks import check_reward_funcs, load_block
from posttrain.pipeline.tasks.promotion import evaluate_and_promote, latest_snapshot, roll_back
from posttrain.pipeline.tasks.report import promotion_report
from posttrain.pipeline.tasks.staging import stage


class PromotionReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    production: str
    candidate: str
    champion: str | None
    promoted: bool
    reason: str
    record: int | None
    candidate_mean: float | None
    champion_mean: float | None


class RollbackReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    production: str
    identity: str
    previous: str | None
    record: int


def _name(kind: str) -> str:
    from datetime import UTC, datetime

    when = flow_run.scheduled_start_time or datetime.now(UTC)
    return renamed(f"{kind}-{when:%Y-%m-%d}-{run_suffix(flow_run.id)}")


@flow(name="promote", flow_run_name=lambda: _name("promote"), log_prints=True)
@flat_parameters(PromoteSettings)
def promote(settings: PromoteSettings) -> PromotionReport:
    """Evaluate a candidate and production's champion on the staging deployment; promote the candidate to
    production only when the gate's decision rule holds, and record the decision in the history."""
    return run_promotion(settings, run=f"promote-{run_suffix(flow_run.id)}")


def run_promotion(settings: PromoteSettings, *, run: str, run_name: str | None = None,
                  default_reward_funcs: list[str] | None = None, candidate: str | None = None) -> PromotionReport:
    """The promote flow's body; the nightly flow runs it as its last step with the run's reward functions.
    ``run`` holds production's lease and writes the record (unique to the flow run, the same across its
    retries); ``run_name``, the run the events name (``run`` when not given)."""
    for ref, what in ((settings.production, "production"), (settings.staging, "staging"), (settings.store, "store")):
        load_block(ref, what)  # a missing block fails here, named, before any eval
    p = settings.promotion
    check_reward_funcs(p.eval_settings(default_reward_funcs).reward_funcs)
    staged = stage(p.eval_dataset, settings.shared_dir)
    candidate = candidate or settings.candidate or latest_snapshot(settings.store, settings.candidate_run)
    done = evaluate_and_promote(candidate, run, p, default_reward_funcs, str(staged.manifest_path),
                                settings.tokenizer, settings.store, settings.staging, settings.production,
                                run_name=run_name)
    promotion_report(settings.production, settings.production, done)
    d = done.decision
    get_run_logger().info("%s %s for %s", "promoted" if d.accepted else "refused", candidate, settings.production)
    return PromotionReport(production=settings.production, candidate=candidate, champion=d.champion,
                           promoted=d.accepted, reason=done.record.reason if done.record else d.reason,
                           record=done.record.seq if done.record else None, candidate_mean=d.candidate_mean,
                           champion_mean=d.champion_mean)


@flow(name="rollback", flow_run_name=lambda: _name("rollback"), log_prints=True)
@flat_parameters(RollbackSettings)
def rollback(settings: RollbackSettings) -> RollbackReport:
    """Make the production deployment serve an earlier version again (rebuilt from its chain), and record
    it in the history."""
    done = roll_back(settings.to, f"rollback-{run_suffix(flow_run.id)}", settings.reason, settings.store,
                     settings.production)
    r = done.record
    get_run_logger().info("%s serves %s again (record #%d)", settings.production, r.identity, r.seq)
    return RollbackReport(production=settings.production, identity=r.identity, previous=r.previous, record=r.seq)
