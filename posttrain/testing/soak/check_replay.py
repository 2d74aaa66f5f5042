"""Promotion histories read from the store and replayed record by record, with the invariants of
docs/promotion.md ("The history", "Rollback", "One writer per deployment") re-implemented here,
not taken from ``posttrain.promote.history``:

- records are ``<8 digits>.json`` numbered 1..N without a gap, each a ``posttrain.promotion/1``
  record holding its own number and deployment;
- each record's ``previous`` is the champion the records before it leave (the champion stack:
  a promotion pushes, a rollback pops back to an identity on the stack or pushes one that is not,
  a ``reverted`` record voids the record it names). A record whose ``previous`` is not that
  champion was written by a writer that did not see the one before it: two writers interleaved;
- a promotion is accepted and a refusal refused by its decision, which compares the record's
  identity with its previous; a promotion or rollback changes the champion;
- a ``reverted`` record names an earlier promotion or rollback, not reverted before, with no
  other switch between them (its writer still held the deployment);
- an operator's ``rollback --to previous`` goes to the entry under the top of the stack;
- a run (a flow run) records at most one decision and one rollback: retries record nothing twice.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from posttrain.testing.soak.check_model import parse_time

FOLDER = ".posttrain/promotions/"
RECORD_RE = re.compile(r"(\d{8})\.json")
FORMAT = "posttrain.promotion/1"
KINDS = {"promotion", "refusal", "rollback", "reverted"}
TO_PREVIOUS = "to the previous champion"  # how posttrain rollback --to previous words its reason


@dataclass
class Replay:
    deployment: str
    records: list[dict] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # identity -> the record that needs it kept (gc's rule)
    switched_to: set[str] = field(default_factory=set)  # every identity a record told production to serve

    @property
    def champion(self) -> str | None:
        return self.stack[-1] if self.stack else None


def champion_stack(records: list[dict]) -> list[str]:
    void = {r.get("reverts") for r in records if r.get("kind") == "reverted"}
    stack: list[str] = []
    for r in records:
        if r.get("kind") == "reverted" or r.get("seq") in void:
            continue
        if r.get("kind") == "promotion":
            stack.append(r.get("identity"))
        elif r.get("kind") == "rollback":
            ident = r.get("identity")
            if ident in stack:
                del stack[len(stack) - stack[::-1].index(ident):]
            else:
                stack.append(ident)
    return stack


def read_histories(store) -> dict[str, Replay]:  # noqa: ANN001 - check_store.StoreReader
    """deployment -> its history replayed, for every history folder under the store's prefix."""
    folders: dict[str, dict[int, str]] = {}
    for key in store.sizes:
        if not key.startswith(FOLDER):
            continue
        dep, _, name = key[len(FOLDER):].partition("/")
        m = RECORD_RE.fullmatch(name)
        if m:
            folders.setdefault(dep, {})[int(m.group(1))] = key
    return {dep: replay(dep, {seq: _load(store, key) for seq, key in keys.items()})
            for dep, keys in sorted(folders.items())}


def _load(store, key: str) -> dict | str:  # noqa: ANN001
    try:
        data = json.loads(store.get(key))
    except ValueError as e:
        return f"{key} is not JSON ({e})"
    return data if isinstance(data, dict) else f"{key} is not a JSON object"


def replay(deployment: str, by_seq: dict[int, dict | str]) -> Replay:
    out = Replay(deployment)
    bad = out.problems.append
    where = f"history of {deployment}"
    if sorted(by_seq) != list(range(1, len(by_seq) + 1)):
        missing = sorted(set(range(1, max(by_seq, default=0) + 1)) - set(by_seq))
        bad(f"{where}: records are not numbered 1..{len(by_seq)} without a gap (missing {missing[:10]})")
    decisions: Counter[str] = Counter()
    rollbacks: Counter[str] = Counter()
    for seq in sorted(by_seq):
        rec = by_seq[seq]
        if isinstance(rec, str):
            bad(f"{where}: {rec}")
            continue
        at = f"{where}, record {seq}"
        kind, ident, prev = rec.get("kind"), rec.get("identity"), rec.get("previous")
        if rec.get("format") != FORMAT or rec.get("seq") != seq or rec.get("deployment") != deployment:
            bad(f"{at}: not a {FORMAT} record of {deployment} numbered {seq} (format {rec.get('format')!r}, "
                f"seq {rec.get('seq')!r}, deployment {rec.get('deployment')!r})")
        if kind not in KINDS or not isinstance(ident, str) or parse_time(rec.get("at")) is None:
            bad(f"{at}: kind {kind!r}, identity {ident!r} or time {rec.get('at')!r} is not valid")
            continue
        stack = champion_stack(out.records)
        top = stack[-1] if stack else None
        if prev != top:
            bad(f"{at} ({kind} of {ident}): previous is {prev}, but the records before it leave {top or 'no champion'}"
                " as the champion (written without seeing the record before it)")
        decision = rec.get("decision")
        if kind in ("promotion", "refusal"):
            _check_decision(at, kind, ident, prev, decision, bad)
        elif decision is not None:
            bad(f"{at}: a {kind} carries a gate decision")
        if kind in ("promotion", "rollback") and ident == prev:
            bad(f"{at}: a {kind} to {ident}, which is already the champion")
        if kind == "rollback":
            if rec.get("run") is None and TO_PREVIOUS in (rec.get("reason") or ""):
                under = stack[-2] if len(stack) > 1 else None
                if ident != under:
                    bad(f"{at}: rollback to the previous champion went to {ident}, the entry under the top is {under}")
            if ident not in out.switched_to:
                out.notes.append(f"{at}: rollback to {ident}, which no earlier record of the history served")
        if kind == "reverted":
            _check_reverted(at, rec, out.records, bad)
        elif rec.get("reverts") is not None:
            bad(f"{at}: a {kind} names a record it reverts")
        run = rec.get("run")
        if run and kind in ("promotion", "refusal"):
            decisions[run] += 1
        elif run and kind == "rollback":
            rollbacks[run] += 1
        if kind in ("promotion", "rollback"):
            out.switched_to.add(ident)
            out.kept.setdefault(ident, f"{deployment} #{seq} ({kind})")
        if prev is not None and kind != "reverted":
            out.kept.setdefault(prev, f"{deployment} #{seq} (the champion a {kind} replaced or kept)")
        out.records.append(rec)
    for run, n in sorted((decisions + rollbacks).items()):
        if decisions[run] > 1 or rollbacks[run] > 1:
            bad(f"{where}: run {run} recorded {decisions[run]} decisions and {rollbacks[run]} rollbacks "
                "(a retry must find its record and record nothing twice)")
    out.stack = champion_stack(out.records)
    return out


def _check_decision(at: str, kind: str, ident: str, prev: str | None, decision: object, bad) -> None:  # noqa: ANN001
    if not isinstance(decision, dict):
        bad(f"{at}: a {kind} without the gate's decision")
        return
    if decision.get("accepted") is not (kind == "promotion"):
        bad(f"{at}: a {kind} whose decision has accepted={decision.get('accepted')!r}")
    if decision.get("candidate") not in (None, ident) or decision.get("champion") not in (None, prev):
        bad(f"{at}: the decision compared {decision.get('candidate')} with {decision.get('champion')}, "
            f"not {ident} with {prev}")


def _check_reverted(at: str, rec: dict, before: list[dict], bad) -> None:  # noqa: ANN001
    target = rec.get("reverts")
    earlier = {r.get("seq"): r for r in before}
    if not isinstance(target, int) or target not in earlier:
        bad(f"{at}: reverts record {target!r}, which is not an earlier record")
        return
    t = earlier[target]
    if t.get("kind") not in ("promotion", "rollback"):
        bad(f"{at}: reverts record {target}, a {t.get('kind')}, which switched nothing")
    if any(r.get("kind") == "reverted" and r.get("reverts") == target for r in before):
        bad(f"{at}: reverts record {target} a second time")
    if rec.get("identity") != t.get("identity"):
        bad(f"{at}: reverts record {target} of {t.get('identity')} but names {rec.get('identity')}")
    between = [r.get("seq") for r in before
               if r.get("seq", 0) > target and r.get("kind") in ("promotion", "rollback")]
    if between:
        bad(f"{at}: reverts record {target}, but records {between} switched production in between "
            "(its writer no longer held the deployment)")
