"""Promotion and rollback: the steps the ``promote`` and ``rollback`` flows and ``posttrain rollback`` run.

Plain Python over a store (the chain's, where the history lives too), hot-loaders (the
deployments' control planes) and a completions client (the staging deployment's data plane).

``promote``:

1. The champion is the history's (``History.champion``); none yet: a first promotion.
2. The champion is evaluated on the staging deployment (its stored eval for the same eval digest
   is reused), then the candidate: each is hot-loaded into staging for its turn, and every reply
   must come from the snapshot under evaluation. An eval that fails makes its side ``None``: the
   gate refuses and the reason says which side and why.
3. The gate decides (``decision.decide``, or ``first_promotion``).
4. Accepted: production hot-loads the candidate, then the promotion is recorded. Refused: the
   refusal is recorded; production is not touched.

``rollback``: the target (``previous``: the champion before the current one in the history; or an
identity of any chain in the store) is hot-loaded into production, then recorded.

Both are safe to run again: a candidate that is the champion already, or a rollback this run
recorded already, is not recorded twice (production is made to serve it again, which is a no-op
when it does).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.chain.errors import FormatError
from posttrain.chain.fetch import SnapshotError, SnapshotSource
from posttrain.chain.format import check_identity
from posttrain.inference.contract import HotLoader, HotLoadResult
from posttrain.promote.decision import Decision, GateConfig, already_champion, decide, first_promotion
from posttrain.promote.evaluate import EvalResult, EvalSettings, EvalStore, eval_digest, eval_rows, evaluate
from posttrain.promote.history import History, Record
from posttrain.redact import scrub
from posttrain.rollouts.client import CompletionsClient
from posttrain.storage import Store

PREVIOUS = "previous"


class PromotionError(ValueError):
    """Bad input to promote or rollback (an unknown identity, no earlier champion): nothing changed."""


@dataclass
class Deployment:
    """A deployment as promotion sees it: its history name, its hot-loader, and (staging) its completions."""

    name: str
    loader: HotLoader
    completions: Callable[[], CompletionsClient] | None = None


@dataclass
class Promotion:
    """What ``promote`` did."""

    decision: Decision
    record: Record | None  # None when the candidate was the champion already (nothing new recorded)
    candidate_eval: EvalResult | None
    champion_eval: EvalResult | None
    served: HotLoadResult | None  # production's hot-load of the candidate, when promoted
    failures: dict[str, str] = field(default_factory=dict)  # side -> why its eval failed

    @property
    def promoted(self) -> bool:
        return self.decision.accepted


@dataclass
class Rollback:
    """What ``rollback`` did."""

    record: Record
    served: HotLoadResult
    recorded_before: bool = False  # a retry: this run had recorded it already


def describe_snapshot(store: Store, identity: str) -> tuple[str, str | None]:
    """("full", None) or ("delta", base) of a snapshot in the store; ``PromotionError`` naming the
    identity when the store has no such snapshot."""
    try:
        check_identity(identity)
        with tempfile.TemporaryDirectory(prefix="posttrain-describe-") as tmp:
            return SnapshotSource(store, "", Path(tmp)).describe(identity)
    except FormatError as e:
        raise PromotionError(str(e)) from None
    except SnapshotError as e:
        raise PromotionError(f"unknown identity {identity}: {e}") from None


def load_version(loader: HotLoader, store: Store, identity: str) -> HotLoadResult:
    """Make a deployment serve ``identity``, a snapshot of any chain in the store: a delta is named
    with its own base, and the deployment rebuilds it from whatever it holds (docs/hotload-api.md)."""
    kind, base = describe_snapshot(store, identity)
    return loader.hot_load(identity, base_identity=base if kind == "delta" else None)


def _eval_side(identity: str, deployment: Deployment, store: Store, rows: list[dict[str, Any]],
               settings: EvalSettings, digest: str, tokenizer, results: EvalStore, *,
               log: Callable[[str], None]) -> EvalResult:
    stored = results.get(digest, identity)
    if stored is not None:
        log(f"{identity}: reusing its stored eval ({digest}): mean reward {stored.mean:.4f}")
        return stored
    load_version(deployment.loader, store, identity)
    assert deployment.completions is not None, "the staging deployment needs completions"
    client = deployment.completions()
    try:
        result = evaluate(rows, settings, client, tokenizer, identity=identity, digest=digest)
    finally:
        client.close()
    log(f"{identity}: mean reward {result.mean:.4f} over {len(result.rewards)} prompts "
        f"x {settings.samples_per_prompt} ({result.seconds:.1f}s)")
    return results.put(result)


def promote(*, store: Store, candidate: str, run: str | None, gate: GateConfig, settings: EvalSettings,
            rows: list[dict[str, Any]], dataset_digest: str, tokenizer, staging: Deployment,
            production: Deployment, log: Callable[[str], None] = lambda _: None) -> Promotion:
    """Evaluate ``candidate`` against production's champion and promote it when the gate says so."""
    if gate.samples_per_prompt != settings.samples_per_prompt:
        raise PromotionError(f"samples_per_prompt: the gate expects {gate.samples_per_prompt} rewards per prompt, "
                             f"the eval samples {settings.samples_per_prompt}")
    chosen = eval_rows(rows, settings)
    if not chosen:
        raise PromotionError(f"eval_dataset: the eval set has zero prompts; the gate needs at least min_prompts "
                             f"{gate.min_prompts}")
    describe_snapshot(store, candidate)  # an unknown candidate is an error before anything is touched
    history = History(store, "", production.name)
    champion = history.champion()
    if champion is not None:
        describe_snapshot(store, champion)
    if champion == candidate:  # promoted already (a retry): production is made to serve it, nothing is recorded
        decision = already_champion(gate, candidate, production.name)
        return Promotion(decision, None, None, None, load_version(production.loader, store, candidate))
    digest = eval_digest(dataset_digest, settings, len(chosen))
    results = EvalStore(store)
    evals: dict[str, EvalResult | None] = {}
    failures: dict[str, str] = {}
    for side, identity in (("champion", champion), ("candidate", candidate)):
        if identity is None:
            continue
        try:
            evals[side] = _eval_side(identity, staging, store, chosen, settings, digest, tokenizer, results, log=log)
        except Exception as e:  # noqa: BLE001 - an eval that fails refuses the candidate, saying why
            # it goes into the history record and the event: a URL's credentials in it are masked
            evals[side], failures[side] = None, scrub(f"{type(e).__name__}: {e}".splitlines()[0])
            log(f"the {side} {identity} could not be evaluated: {failures[side]}")
    cand, champ = evals.get("candidate"), evals.get("champion")
    if champion is None:
        decision = first_promotion(gate, cand.rewards if cand else None, candidate=candidate)
    else:
        decision = decide(gate, cand.rewards if cand else None, champ.rewards if champ else None,
                          candidate=candidate, champion=champion)
    reason = decision.reason + "".join(f"; {side}: {why}" for side, why in failures.items())
    if not decision.accepted:
        record = history.append(Record(kind="refusal", deployment=production.name, identity=candidate,
                                       previous=champion, run=run, decision=decision, reason=reason))
        return Promotion(decision, record, cand, champ, None, failures)
    served = load_version(production.loader, store, candidate)
    record = history.append(Record(kind="promotion", deployment=production.name, identity=candidate,
                                   previous=champion, run=run, decision=decision, reason=reason))
    return Promotion(decision, record, cand, champ, served, failures)


def rollback_target(history: History, to: str) -> str:
    """The identity ``to`` names: ``previous`` (the champion before the current one), or itself."""
    if to != PREVIOUS:
        try:
            return check_identity(to, "--to")
        except FormatError as e:
            raise PromotionError(str(e)) from None
    records = history.records()
    target = history.previous_champion()
    if target is None:
        champion = history.champion()
        raise PromotionError(
            f"--to previous: deployment {history.deployment} has no earlier champion in its history "
            f"({len(records)} records; " + (f"the champion {champion} is the first)" if champion else "no promotion yet)"))
    return target


def rollback(*, store: Store, production: Deployment, to: str, run: str | None = None, reason: str | None = None,
             log: Callable[[str], None] = lambda _: None) -> Rollback:
    """Make production serve ``to`` (``previous`` or an identity) again, and record it.

    ``run`` names who rolls back (a flow run); a retry of the same ``run`` whose rollback was
    recorded already makes production serve that record's identity and records nothing new."""
    history = History(store, "", production.name)
    records = history.records()
    if run is not None and records and records[-1].kind == "rollback" and records[-1].run == run:
        done = records[-1]
        log(f"{run} rolled {production.name} back to {done.identity} already; checking that it serves it")
        return Rollback(done, load_version(production.loader, store, done.identity), recorded_before=True)
    target = rollback_target(history, to)
    describe_snapshot(store, target)  # unknown identity: nothing is touched
    champion = history.champion()
    if target == champion:
        raise PromotionError(f"--to {to}: {target} is already the champion of {production.name}")
    served = load_version(production.loader, store, target)
    why = reason or (f"rolled back from {champion} to the previous champion" if to == PREVIOUS
                     else f"rolled back from {champion or 'no champion'} to {target}")
    record = history.append(Record(kind="rollback", deployment=production.name, identity=target,
                                   previous=champion, run=run, reason=" ".join(why.split())))
    log(f"{production.name} serves {target} again ({served.seconds:.1f}s); recorded as #{record.seq}")
    return Rollback(record, served)
