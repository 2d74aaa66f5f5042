"""Retention across runs: the engine of ``posttrain gc`` (docs/retention.md).

The rule, one for the whole store (or one prefix of it):

1. The runs are those with a ledger in the store (``.posttrain/runs/<run>/``), ordered by their
   newest publication (the largest ``published_at`` of their ledger entries); a run that never
   published a snapshot is left alone.
2. The newest ``keep_runs`` runs, or every run with a publication within ``keep_days`` days,
   are kept whole.
3. Protected versions are every version of a kept run, every identity in ``protect``, every
   identity the promotion histories in the store need (``history_roots``: each deployment's
   champion stack, and the identity and ``previous`` of every promotion and rollback record; not
   a refused candidate) and the caller's ``roots`` that the store has (what the deployments
   serve). A protected version keeps its chain prefix: its full snapshot and every delta up to it.
4. Every other snapshot of the other runs is deleted: whole chains, and the deltas after the
   newest protected version of a chain.

Deletion order, so that a reader never finds a version whose base is gone, nor a half-deleted
snapshot that looks whole: run by run, chain by chain, the newest delta first and the full
snapshot last; in each snapshot the index (the commit marker) first, then its other files, then
its ledger entry. A run all of whose snapshots went loses its whole ledger folder; a run that
keeps some keeps its step claims and ``latest.json`` (a publisher of it still refuses old steps).

gc holds each run's exclusive lease (``lease.GcLease``) while it deletes that run's snapshots
and re-reads the run's ledger under it: a run being published (a live publisher lease), or one
that published since the plan was made, is skipped and left for the next gc.

Under the same lease, before any delete of the run, gc looks at the production deployments'
leases (``posttrain.promote.lease``) and skips the run while a promotion or rollback holds one,
then reads every promotion history again and keeps whatever a record written since the plan
names. A promotion or rollback writes its deployment lease, then waits while any run's gc lease
is live, and only then records: each side writes before it reads the other's, so gc never
deletes a snapshot (nor its chain prefix) that a record written before the delete names.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.errors import ChainError
from posttrain.chain.format import IDENTITY_RE, MAX_CHAIN_DELTAS, slime_dir
from posttrain.promote.history import PROMOTIONS, History, HistoryError, champions, check_deployment
from posttrain.promote.lease import live_deployment_leases
from posttrain.publish.lease import GC_TTL, GcLease, RunBusy
from posttrain.publish.ledger import RUN_NAME_RE, RUNS_PREFIX, Ledger, LedgerEntry
from posttrain.storage import NotFound, Store

DAY = 86400.0
_SLIME_BASE = re.compile(r"^\d{6}$")  # a slime delta names its base by the six digits of weight_vNNNNNN


class GcError(ChainError):
    """gc refuses its input (nothing was deleted) or stopped."""


class GcConfig(BaseModel):
    """What to keep: ``keep_runs`` or ``keep_days`` (one of them), and protected identities."""

    model_config = ConfigDict(extra="forbid")

    keep_runs: int | None = Field(None, ge=1, description="Keep the newest N runs whole.")
    keep_days: float | None = Field(None, gt=0, description="Keep whole every run with a publication within D days.")
    protect: frozenset[str] = Field(frozenset(), description="Identities kept with their chain prefix, in any run.")

    @field_validator("protect", mode="before")
    @classmethod
    def _identities(cls, v: object) -> object:
        return frozenset(v) if isinstance(v, Iterable) and not isinstance(v, str | bytes) else v

    @model_validator(mode="after")
    def _one_rule(self) -> GcConfig:
        if (self.keep_runs is None) == (self.keep_days is None):
            raise ValueError("give keep_runs or keep_days, exactly one of them")
        return self


@dataclass(frozen=True)
class Doomed:
    """A snapshot gc deletes."""

    run: str
    identity: str
    kind: str
    step: int
    bytes: int
    chain: str  # the full snapshot its chain starts from


@dataclass
class RunSummary:
    run: str
    newest: float  # unix time of its newest publication
    snapshots: int
    kept: bool


@dataclass
class GcPlan:
    store: str
    runs: list[RunSummary]  # newest first
    protected: set[str]  # every identity kept by a protected version (its chain prefix included)
    doomed: list[Doomed]  # in deletion order
    planned: dict[str, set[str]]  # run -> its ledger's identities when planned
    whole: set[str]  # runs every snapshot of which goes
    # the roots of ``protected`` and why each is kept ("kept run R", "history of D", "--protect",
    # or the caller's reason), several reasons joined by "; "
    protected_by: dict[str, str] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)  # roots named that the store lacks: nothing to keep
    history: dict[str, str] = field(default_factory=dict)  # what the promotion histories needed when planned

    def held_back(self) -> dict[str, str]:
        """The roots kept for another reason than being a version of a kept run: what the dry run lists."""
        return {i: why for i, why in sorted(self.protected_by.items())
                if any(not w.startswith("kept run ") for w in why.split("; "))}

    @property
    def total_bytes(self) -> int:
        return sum(d.bytes for d in self.doomed)


@dataclass
class GcResult:
    deleted: list[Doomed] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # run -> why

    @property
    def freed_bytes(self) -> int:
        return sum(d.bytes for d in self.deleted)


def run_names(store: Store) -> list[str]:
    names = {key[len(RUNS_PREFIX):].split("/", 1)[0] for key in store.list(RUNS_PREFIX)}
    return sorted(n for n in names if RUN_NAME_RE.fullmatch(n))


def history_roots(store: Store) -> dict[str, str]:
    """What the promotion histories in ``store`` need kept (identity -> "history of <deployment>"):
    for each deployment folder ``.posttrain/promotions/<deployment>/``, the identities on its champion
    stack (what ``rollback --to previous`` can reach), and the identity and ``previous`` of each
    promotion and rollback record (a refusal's ``previous`` too: it was the champion; the refused
    candidate is not kept). ``GcError`` naming the key for a record that cannot be read."""
    folder = PROMOTIONS + "/"
    deployments = sorted({rest.split("/", 1)[0] for key in store.list(folder)
                          if "/" in (rest := key[len(folder):])})
    out: dict[str, set[str]] = {}
    for deployment in deployments:
        try:
            check_deployment(deployment)
        except HistoryError:
            continue  # not a history folder: not ours to read
        try:
            records = History(store, "", deployment).records()
        except HistoryError as e:
            text = " ".join(str(e).split())
            raise GcError(f"promotion history of deployment {deployment}: {text}; gc stopped, nothing was deleted") \
                from None
        needed = set(champions(records))
        for r in records:
            needed.update(i for i in (None if r.kind == "refusal" else r.identity, r.previous) if i is not None)
        for identity in needed:
            out.setdefault(identity, set()).add(f"history of {deployment}")
    return {i: "; ".join(sorted(why)) for i, why in out.items()}


def plan_gc(store: Store, config: GcConfig, *, now: float | None = None,
            roots: Mapping[str, str] | None = None) -> GcPlan:
    """What the rule deletes in ``store``, in deletion order; reads only. ``GcError`` for a protected
    identity the store does not have (a typo would otherwise protect nothing) and for a promotion
    history record that cannot be read. ``roots`` (identity -> why, e.g. what a deployment serves)
    are protected too where the store has them; the others are listed in ``GcPlan.absent``, as are
    the identities the histories name that the store no longer has."""
    now = time.time() if now is None else now
    ledgers = {run: Ledger(store, run).entries() for run in run_names(store)}
    runs = sorted((RunSummary(run, max(e.published_at for e in es), len(es), False)
                   for run, es in ledgers.items() if es), key=lambda r: (r.newest, r.run), reverse=True)
    cutoff = now - (config.keep_days or 0) * DAY
    for i, r in enumerate(runs):
        r.kept = i < config.keep_runs if config.keep_runs is not None else r.newest >= cutoff
    owners: dict[str, list[LedgerEntry]] = {}
    for r in runs:
        for e in ledgers[r.run]:
            owners.setdefault(e.identity, []).append(e)
    for identity in sorted(config.protect):
        if identity in owners or (IDENTITY_RE.fullmatch(identity) and store.exists(f"{identity}/{INDEX_NAME}")):
            continue
        raise GcError(f"protected identity {identity!r} is not a snapshot in {store.uri} (no run's ledger has "
                      "it and it has no index): a typo? nothing was deleted")
    needed_by_history = history_roots(store)  # a record that cannot be read stops gc here, before any delete
    reasons: dict[str, list[str]] = {}
    for r in runs:
        for e in ledgers[r.run] if r.kept else ():
            reasons.setdefault(e.identity, []).append(f"kept run {r.run}")
    for identity in config.protect:
        reasons.setdefault(identity, []).append("--protect")
    absent: dict[str, str] = {}
    for found in (needed_by_history, roots or {}):
        for identity, why in sorted(found.items()):
            if identity in owners or identity in reasons or \
                    (IDENTITY_RE.fullmatch(identity) and store.exists(f"{identity}/{INDEX_NAME}")):
                reasons.setdefault(identity, []).append(why)
            else:
                absent[identity] = "; ".join(filter(None, (absent.get(identity), why)))
    protected: set[str] = set()
    for identity in reasons:
        protected.update(_prefix(store, identity, owners))
    doomed: list[Doomed] = []
    planned: dict[str, set[str]] = {}
    whole: set[str] = set()
    for r in runs:
        if r.kept:
            continue
        entries = ledgers[r.run]
        planned[r.run] = {e.identity for e in entries}
        going = [e for e in entries if e.identity not in protected]
        doomed += _deletion_order(r.run, going, entries)
        if going and len(going) == len(entries):
            whole.add(r.run)
    protected_by = {i: "; ".join(dict.fromkeys(why)) for i, why in reasons.items()}
    return GcPlan(store.uri, runs, protected, doomed, planned, whole, protected_by, absent, needed_by_history)


def _base(e: LedgerEntry, same_run: set[str]) -> str | None:
    if e.kind == "full" or e.base is None:
        return None
    if e.base not in same_run and _SLIME_BASE.fullmatch(e.base):
        return slime_dir(int(e.base))
    return e.base


def _prefix(store: Store, identity: str, owners: dict[str, list[LedgerEntry]]) -> list[str]:
    """``identity`` and every snapshot it builds on, back to its full snapshot: through the ledgers,
    or through the indexes in the store for a snapshot no ledger has (another producer's)."""
    out: list[str] = []
    cur: str | None = identity
    while cur is not None and cur not in out and len(out) <= MAX_CHAIN_DELTAS + 1:
        out.append(cur)
        if cur in owners:
            e = owners[cur][0]
            cur = _base(e, {x.identity for x in owners[cur]})
        else:
            cur = _index_base(store, cur)
    return out


def _index_base(store: Store, identity: str) -> str | None:
    import json

    try:
        meta = json.loads(store.get_bytes(f"{identity}/{INDEX_NAME}")[0]).get("metadata") or {}
    except (NotFound, ValueError, AttributeError):
        return None
    base = meta.get("base_version") if "delta_encoding" in meta else None
    if not isinstance(base, str):
        return None
    return slime_dir(int(base)) if _SLIME_BASE.fullmatch(base) else base


def _deletion_order(run: str, going: list[LedgerEntry], entries: list[LedgerEntry]) -> list[Doomed]:
    """Chains newest first; in each, the deepest delta first and the full snapshot last."""
    by_id = {e.identity: e for e in entries}
    ids = set(by_id)
    depth: dict[str, tuple[int, str]] = {}  # identity -> (deltas above its full snapshot, that snapshot)

    def walk(identity: str) -> tuple[int, str]:
        trail: list[str] = []
        cur: str | None = identity
        while cur in by_id and cur not in depth and cur not in trail:
            trail.append(cur)
            cur = _base(by_id[cur], ids)
        # below the trail: a snapshot placed already, else the trail ends at its full snapshot
        d, root = depth[cur] if cur in depth else (-1, trail[-1])
        for ident in reversed(trail):
            d += 1
            depth[ident] = (d, root)
        return depth[identity]

    newest: dict[str, float] = {}
    for e in entries:
        root = walk(e.identity)[1]
        newest[root] = max(newest.get(root, 0.0), e.published_at)
    order = sorted(going, key=lambda e: (newest[depth[e.identity][1]], depth[e.identity][0], e.published_at),
                   reverse=True)
    return [Doomed(run, e.identity, e.kind, e.step, e.stored_bytes, depth[e.identity][1]) for e in order]


def delete_snapshot(store: Store, identity: str) -> None:
    """The index first (the commit marker: from then on no reader takes the snapshot as whole),
    then whatever else is under the snapshot's folder."""
    store.delete([f"{identity}/{INDEX_NAME}"])
    store.delete(list(store.list(f"{identity}/")))


def run_gc(store: Store, plan: GcPlan, *, progress: Callable[[Doomed], None] | None = None,
           lease_ttl: float = GC_TTL) -> GcResult:
    """Delete what ``plan`` lists, run by run under the run's gc lease (module docstring). A run
    being published, or changed since the plan, is skipped (``GcResult.skipped``), never waited for."""
    result = GcResult()
    by_run: dict[str, list[Doomed]] = {}
    for d in plan.doomed:
        by_run.setdefault(d.run, []).append(d)
    for run, items in by_run.items():
        lease = GcLease(store, run, ttl=lease_ttl)
        try:
            lease.acquire()
        except RunBusy as e:
            result.skipped[run] = str(e)
            continue
        try:
            ledger = Ledger(store, run)
            now = {e.identity for e in ledger.entries()}
            if now != plan.planned[run]:
                result.skipped[run] = (f"run {run}: its ledger changed since the plan ({len(now)} snapshots, "
                                       f"{len(plan.planned[run])} planned); left for the next gc")
                continue
            items = _still_doomed(store, plan, run, items, result)
            if items is None:
                continue
            for d in items:
                lease.renew()  # stops (LeaseLost) rather than delete without a live lease
                delete_snapshot(store, d.identity)
                ledger.delete(d.identity)  # last: a gc stopped midway finds the snapshot again next time
                result.deleted.append(d)
                if progress is not None:
                    progress(d)
            if run in plan.whole and len(items) == len(plan.planned[run]):
                rest = [k for k in store.list(ledger.root) if k != lease.key]
                store.delete(rest)  # the run is gone: its claims, settings and latest pointer too
        finally:
            lease.release()
    return result


def _still_doomed(store: Store, plan: GcPlan, run: str, items: list[Doomed], result: GcResult) -> list[Doomed] | None:
    """Under the run's gc lease (written first): None (the run is skipped) while a promotion or
    rollback holds a deployment; else ``items`` less what a history record written since the plan
    needs (with its chain prefix)."""
    busy = live_deployment_leases(store, time.time())
    if busy:
        deployment, held = sorted(busy.items())[0]
        result.skipped[run] = (f"run {run}: deployment {deployment} is being changed ({held.describe(time.time())}); "
                               "left for the next gc")
        return None
    new = set(history_roots(store)) - set(plan.history)
    if not new:
        return items
    owners: dict[str, list[LedgerEntry]] = {}
    for name in run_names(store):
        for e in Ledger(store, name).entries():
            owners.setdefault(e.identity, []).append(e)
    keep = {i for identity in new for i in _prefix(store, identity, owners)}
    return [d for d in items if d.identity not in keep]
