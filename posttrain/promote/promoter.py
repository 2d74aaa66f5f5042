"""Promotion and rollback: the steps the ``promote`` and ``rollback`` flows and ``posttrain rollback`` run
(docs/promotion.md), over a store (the chain's, where the history lives too), hot-loaders (the
deployments' control planes) and a completions client (the staging deployment's data plane).

``promote``: configuration errors first (too few eval prompts, an unknown candidate, a champion
gone from the store); a retry of a run that decided already returns its record; the champion,
then the candidate are evaluated on staging (a stored eval for the same digest is reused; an
eval that fails makes its side ``None``, and the gate refuses saying which side and why); the
gate decides. With no champion in the history, the champion is what production serves, its boot
weights, evaluated on production itself (``posttrain.promote.sides.eval_served``; the gate's
``first_promotion: own_eval`` accepts a first candidate on its own eval instead). ``rollback``: the target is ``previous`` (the champion before the current one) or
any identity of the store.

Both decide, record and switch under production's lease (``posttrain.promote.lease``; another
holder: ``OperationLost``), the champion read again under it. The record is written before
production is switched; a switch that fails is followed by a ``reverted`` record and production
is made to serve the champion before it again; a holder killed in between leaves its lease
marked ``pending``, and the next holder makes production serve the history's champion first.
A retry by the same run finds its own record anywhere in the history and records nothing new.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.chain.errors import FormatError
from posttrain.chain.fetch import SnapshotError, SnapshotSource
from posttrain.chain.format import check_identity
from posttrain.inference.contract import HotLoader, HotLoadResult
from posttrain.promote.decision import Decision, GateConfig, already_champion, decide, first_promotion
from posttrain.promote.evaluate import EvalResult, EvalSettings, EvalStore, eval_digest, eval_rows
from posttrain.promote.history import History, Record, champions, effective
from posttrain.promote.sides import (
    Deployment,
    PromotionError,
    describe_snapshot,
    eval_served,
    eval_snapshot,
    load_version,
    served_name,
)
from posttrain.promote.lease import DEPLOYMENT_TTL, DeploymentBusy, DeploymentLease, holding
from posttrain.publish.lease import live_gc_leases
from posttrain.redact import scrub
from posttrain.rollouts.client import CompletionsClient
from posttrain.storage import Store

PREVIOUS = "previous"
GC_WAIT = 1800.0  # how long an operation waits, holding its deployment, for gc to finish a run
UNREAD = "(not read)"  # rollback's seen_champion when its caller read no champion beforehand


class OperationLost(Exception):
    """Another operation holds the deployment, or changed its champion meanwhile: nothing was changed."""


class SwitchFailed(Exception):
    """Production could not be switched to what was recorded. ``record`` is the ``reverted`` record
    that says so and what production serves (None when even that could not be written)."""

    def __init__(self, message: str, record: Record | None):
        super().__init__(message)
        self.record = record


@dataclass
class Promotion:
    """What ``promote`` did."""

    decision: Decision
    record: Record | None  # None when the candidate was the champion already (nothing new recorded)
    candidate_eval: EvalResult | None
    champion_eval: EvalResult | None
    served: HotLoadResult | None  # production's hot-load of the candidate, when promoted
    failures: dict[str, str] = field(default_factory=dict)  # side -> why its eval failed
    recorded_before: bool = False  # a retry: this run had recorded its decision already

    @property
    def promoted(self) -> bool:
        return self.decision.accepted


@dataclass
class Rollback:
    """What ``rollback`` did."""

    record: Record
    served: HotLoadResult
    recorded_before: bool = False  # a retry: this run had recorded it already


def _one_line(e: BaseException) -> str:
    return scrub(f"{type(e).__name__}: {e}".splitlines()[0]) if str(e) else type(e).__name__


def check_champion(store: Store, deployment: str, champion: str | None) -> None:
    """``PromotionError`` naming the champion as such when its snapshot is gone from the store."""
    try:
        if champion is not None:
            describe_snapshot(store, champion)
    except PromotionError as e:
        why = str(e).removeprefix(f"unknown identity {champion}: ")
        raise PromotionError(
            f"production: the champion of deployment {deployment}, {champion} (its history's last promotion or "
            f"rollback), is not in the store ({why}); no candidate can be compared with it: make production serve "
            f"a snapshot the store has first, e.g. posttrain rollback --deployment {deployment} --to "
            "<an existing snapshot>") from None


def _own_record(records: list[Record], run: str | None, kinds: tuple[str, ...],
                identity: str | None = None) -> Record | None:
    """The last record ``run`` wrote of one of ``kinds`` (about ``identity``), anywhere in the
    history, unless it was reverted: a retry of that run has done its work already."""
    if run is None:
        return None
    mine = [r for r in effective(records) if r.run == run and r.kind in kinds and identity in (None, r.identity)]
    return mine[-1] if mine else None


@contextlib.contextmanager
def _deployment_held(store: Store, production: Deployment, holder: str, run: str | None, *, ttl: float,
                     gc_wait: float, log: Callable[[str], None]) -> Iterator[tuple[DeploymentLease, History]]:
    """Hold production's lease (another holder: ``OperationLost``), wait while gc deletes a run
    (write-before-read against gc: posttrain.promote.lease), finish what an earlier holder left
    unfinished, and yield the lease with the history to read again under it."""
    with contextlib.ExitStack() as stack:
        try:
            lease = stack.enter_context(holding(store, production.name, holder, run=run, ttl=ttl))
        except DeploymentBusy as e:
            raise OperationLost(str(e)) from None
        _wait_for_gc(store, lease, gc_wait, log)
        history = History(store, "", production.name)
        _repair(store, production, lease, history, log)
        yield lease, history


def _wait_for_gc(store: Store, lease: DeploymentLease, gc_wait: float, log: Callable[[str], None],
                 poll: float = 0.5) -> None:
    deadline = time.monotonic() + gc_wait
    told = False
    while busy := live_gc_leases(store, time.time()):
        lease.check()
        run, held = sorted(busy.items())[0]
        if time.monotonic() > deadline:
            raise OperationLost(f"deployment {lease.deployment}: gc has held run {run} for over {gc_wait:g}s "
                                f"({held.describe(time.time())}); nothing was changed")
        if not told:
            log(f"deployment {lease.deployment}: waiting for gc to finish run {run} before changing anything")
            told = True
        time.sleep(poll)


def _repair(store: Store, production: Deployment, lease: DeploymentLease, history: History,
            log: Callable[[str], None]) -> None:
    """An earlier holder left its switch unfinished (killed, or its restore failed): production is
    made to serve the history's champion before anything else is done."""
    pending = lease.left_pending
    if pending is None:
        return
    champion = history.champion()
    log(f"deployment {production.name}: an earlier operation left production's switch to {pending} unfinished; "
        f"making it serve the history's champion {champion or '(none: nothing to load)'}")
    if champion is not None:
        try:
            load_version(production.loader, store, champion)
        except Exception as e:  # noqa: BLE001 - the lease stays marked: the next holder tries again
            raise SwitchFailed(f"deployment {production.name}: an earlier operation left production's switch to "
                               f"{pending} unfinished, and making it serve the history's champion {champion} "
                               f"failed ({_one_line(e)}); nothing else was done", None) from e
    lease.mark(None)


def _switch(store: Store, production: Deployment, lease: DeploymentLease, history: History, record: Record,
            before: str | None) -> HotLoadResult:
    """Make production serve what ``record`` (just written) says; on failure, revert it (``SwitchFailed``)."""
    try:
        served = load_version(production.loader, store, record.identity)
    except Exception as e:  # noqa: BLE001 - whatever failed, production must not contradict the history
        raise _revert(store, production, lease, history, record, before, e) from e
    lease.mark(None)
    return served


def _revert(store: Store, production: Deployment, lease: DeploymentLease, history: History, record: Record,
            before: str | None, error: Exception) -> SwitchFailed:
    name = production.name
    restore_error = None
    if before is not None:
        try:
            load_version(production.loader, store, before)
        except Exception as e:  # noqa: BLE001 - said in the record; the lease stays marked for the next holder
            restore_error = _one_line(e)
    if before is None:
        outcome = "there was no earlier champion to restore"
    elif restore_error is None:
        outcome = f"production serves {before} again"
    else:
        outcome = (f"restoring {before} failed too ({restore_error}): the next promotion or rollback of {name} "
                   f"makes production serve {before}")
    reason = (f"the hot-load of {record.identity} into {name} failed ({_one_line(error)}); record #{record.seq} is "
              f"reverted and {outcome}")
    try:
        reverted = history.append(Record(kind="reverted", deployment=name, identity=record.identity,
                                         previous=record.identity, run=record.run, reverts=record.seq, reason=reason))
    except Exception as e:  # noqa: BLE001 - the lease stays marked: the next holder serves the history's champion
        return SwitchFailed(f"{reason}; but the reverted record could not be written ({_one_line(e)}): the history's "
                            f"champion is still {record.identity}, and the next promotion or rollback of {name} makes "
                            "production serve it", None)
    lease.mark(None if restore_error is None else before)
    return SwitchFailed(f"{reason} (record #{reverted.seq})", reverted)


def promote(*, store: Store, candidate: str, run: str | None, gate: GateConfig, settings: EvalSettings,
            rows: list[dict[str, Any]], dataset_digest: str, tokenizer, staging: Deployment,
            production: Deployment, log: Callable[[str], None] = lambda _: None,
            lease_ttl: float = DEPLOYMENT_TTL, gc_wait: float = GC_WAIT) -> Promotion:
    """Evaluate ``candidate`` against production's champion and promote it when the gate says so."""
    if gate.samples_per_prompt != settings.samples_per_prompt:
        raise PromotionError(f"samples_per_prompt: the gate expects {gate.samples_per_prompt} rewards per prompt, "
                             f"the eval samples {settings.samples_per_prompt}")
    chosen = eval_rows(rows, settings)
    if len(chosen) < gate.min_prompts:  # known now: both evals would be spent on a certain refusal
        limit = f" (eval_max_prompts {settings.max_prompts})" if getattr(settings, "max_prompts", None) else ""
        raise PromotionError(f"eval_dataset: the eval set has {len(chosen) or 'zero'} prompts{limit}; the gate needs "
                             f"at least min_prompts {gate.min_prompts}")
    describe_snapshot(store, candidate)  # an unknown candidate is an error before anything is touched
    held = dict(ttl=lease_ttl, gc_wait=gc_wait, log=log)
    records = History(store, "", production.name).records()
    champion = (champions(records) or [None])[-1]
    check_champion(store, production.name, champion)
    boot = champion is None and gate.first_promotion == "beat_boot"  # the champion: what production serves
    if boot and production.completions is None:
        raise PromotionError(f"production: deployment {production.name} has no champion yet, and its first candidate "
                             "is compared with the weights it serves (gate_first_promotion beat_boot), but it has "
                             "no completions endpoint to evaluate them on: give its block a gateway_url, or set "
                             "gate_first_promotion own_eval")
    if champion == candidate:  # promoted already (a retry): production is made to serve it, nothing is recorded
        with _deployment_held(store, production, "promotion", run, **held) as (_, history):
            _check_unchanged(history, champion, candidate)
            decision = already_champion(gate, candidate, production.name)
            return Promotion(decision, None, None, None, load_version(production.loader, store, candidate))
    if _own_record(records, run, ("promotion", "refusal"), candidate) is not None:  # a retry of this run
        with _deployment_held(store, production, "promotion", run, **held) as (_, history):
            return _decided_before(store, production, history, run, candidate, log)
    digest = eval_digest(dataset_digest, settings, len(chosen))
    results = EvalStore(store)
    evals: dict[str, EvalResult | None] = {}
    failures: dict[str, str] = {}
    for side, identity in (("champion", champion), ("candidate", candidate)):
        if identity is None and not boot:
            continue
        try:
            evals[side] = (eval_served(production, chosen, settings, digest, tokenizer, log=log) if identity is None
                           else eval_snapshot(identity, staging, store, chosen, settings, digest, tokenizer, results,
                                           log=log))
        except Exception as e:  # noqa: BLE001 - an eval that fails refuses the candidate, saying why
            # it goes into the history record and the event: a URL's credentials in it are masked
            evals[side], failures[side] = None, _one_line(e)
            log(f"the {side} {identity} could not be evaluated: {failures[side]}")
    cand, champ = evals.get("candidate"), evals.get("champion")
    if champion is None and not boot:
        decision = first_promotion(gate, cand.rewards if cand else None, candidate=candidate)
    else:
        decision = decide(gate, cand.rewards if cand else None, champ.rewards if champ else None,
                          candidate=candidate, champion=champion,
                          champion_name=served_name(champ) if boot else None)
    reason = decision.reason + "".join(f"; {side}: {why}" for side, why in failures.items())
    kind = "promotion" if decision.accepted else "refusal"
    with _deployment_held(store, production, "promotion", run, **held) as (lease, history):
        if _own_record(history.records(), run, ("promotion", "refusal"), candidate) is not None:
            return _decided_before(store, production, history, run, candidate, log)
        _check_unchanged(history, champion, candidate)
        describe_snapshot(store, candidate)  # still there (gc may have run while it was evaluated)
        record = Record(kind=kind, deployment=production.name, identity=candidate, previous=champion, run=run,
                        decision=decision, reason=reason)
        if not decision.accepted:
            lease.mark(None)  # proves the lease still ours (a conditional write) before the refusal is recorded
            return Promotion(decision, history.append(record), cand, champ, None, failures)
        lease.mark(candidate)  # before the record: a holder killed from here on is repaired by the next one
        record = history.append(record)
        served = _switch(store, production, lease, history, record, champion)
    return Promotion(decision, record, cand, champ, served, failures)


def _check_unchanged(history: History, champion: str | None, candidate: str) -> None:
    """Under the lease: the champion is still the one the decision was made against."""
    records = history.records()
    if (now := (champions(records) or [None])[-1]) != champion:
        raise OperationLost(f"deployment {history.deployment}: its champion changed while {candidate} was evaluated "
                            f"({champion or 'none'} then, {now or 'none'} now, record #{records[-1].seq}); nothing "
                            f"was recorded or hot-loaded: promote again to decide against {now or 'no champion'}")


def _decided_before(store: Store, production: Deployment, history: History, run: str | None, candidate: str,
                    log: Callable[[str], None]) -> Promotion:
    """A retry of a run whose decision is recorded: production is made to serve the history's champion."""
    records = history.records()
    done = _own_record(records, run, ("promotion", "refusal"), candidate)
    assert done is not None and done.decision is not None
    log(f"{run} recorded its decision on {candidate} already (#{done.seq}, a {done.kind}); recording nothing new")
    stack = champions(records)
    served = load_version(production.loader, store, stack[-1]) if done.kind == "promotion" and stack else None
    return Promotion(done.decision, done, None, None, served, recorded_before=True)


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
             seen_champion: str | None = UNREAD, log: Callable[[str], None] = lambda _: None,
             lease_ttl: float = DEPLOYMENT_TTL, gc_wait: float = GC_WAIT) -> Rollback:
    """Make production serve ``to`` (``previous`` or an identity) again, and record it.

    ``run`` names who rolls back (a flow run); a retry of the same ``run`` whose rollback was
    recorded (anywhere in the history) records nothing new and makes production serve the
    history's champion. ``seen_champion``: the champion the caller checked its plan against
    (``posttrain rollback``); another one under the lease and the rollback loses."""
    if reason is not None and not reason.split():
        raise PromotionError("reason: is empty (give one line saying why, or none for the default)")
    if to != PREVIOUS:
        rollback_target(History(store, "", production.name), to)  # a malformed identity: before the lease
    with _deployment_held(store, production, "rollback", run, ttl=lease_ttl, gc_wait=gc_wait, log=log) \
            as (lease, history):
        records = history.records()
        done = _own_record(records, run, ("rollback",))
        if done is not None:
            champion = champions(records)[-1]
            log(f"{run} rolled {production.name} back to {done.identity} already (#{done.seq}); making production "
                f"serve the history's champion {champion}")
            return Rollback(done, load_version(production.loader, store, champion), recorded_before=True)
        target = rollback_target(history, to)
        describe_snapshot(store, target)  # unknown identity (or deleted by gc meanwhile): nothing is touched
        champion = history.champion()
        if seen_champion != UNREAD and champion != seen_champion:
            raise OperationLost(f"deployment {production.name}: its champion changed since the rollback was planned "
                                f"({seen_champion or 'none'} then, {champion or 'none'} now); nothing was changed")
        if target == champion:
            raise PromotionError(f"--to {to}: {target} is already the champion of {production.name}")
        why = reason or (f"rolled back from {champion} to the previous champion" if to == PREVIOUS
                         else f"rolled back from {champion or 'no champion'} to {target}")
        lease.mark(target)  # before the record: a holder killed from here on is repaired by the next one
        record = history.append(Record(kind="rollback", deployment=production.name, identity=target,
                                       previous=champion, run=run, reason=" ".join(why.split())))
        served = _switch(store, production, lease, history, record, champion)
    log(f"{production.name} serves {target} again ({served.seconds:.1f}s); recorded as #{record.seq}")
    return Rollback(record, served)
