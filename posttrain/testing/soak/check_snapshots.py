"""Check 1, ``snapshots``: what the store holds is whole and accounted for.

- every snapshot (a folder with an index) verifies against its ``posttrain.checksums.json`` byte
  for byte, a delta's base is in the store, and its version rebuilds (each changed tensor's delta
  checksum) from a full snapshot within 128 deltas (``check_store``);
- each rebuilt version's content digest is the one its ledger entry records, and its identity is
  the one its run, step, kind, base and content name (docs/delta-format.md, "Identities");
- every ledger entry's snapshot is in the store with every file it lists, same size, same xxh3-128;
- a step has one version in its run's ledger (a later full snapshot of the same weights aside);
- no orphans: no folder without an index (a half-uploaded snapshot), no indexed snapshot that no
  ledger lists, no bookkeeping key outside the layout of docs/layout.md, no unfinished multipart
  upload. Orphans are not judged while a publisher's lease is live (a run still being published);
  the leases themselves are check 6's.
"""

from __future__ import annotations

import xxhash

from posttrain.testing.soak.check_context import Context
from posttrain.testing.soak.check_model import CheckResult, parse_time
from posttrain.testing.soak.check_store import (
    BOOK,
    DEPLOYMENT_LEASE_RE,
    EVAL_KEY_RE,
    GC_LEASE_RE,
    HISTORY_KEY_RE,
    RUN_FILE_RE,
    RUN_KEY_RE,
    content_digest,
    expected_identity,
)


def check_snapshots(ctx: Context) -> CheckResult:
    res = CheckResult("snapshots")
    store, snaps = ctx.store, ctx.snapshots
    rebuilt, unbuildable = ctx.rebuilt
    for snap in snaps.values():
        res.items += 1
        for p in snap.problems:
            res.bad(p)
    for p in unbuildable:
        res.bad(p)
    listed: dict[str, str] = {}  # identity -> run whose ledger lists it
    for run, entries in sorted(ctx.ledgers.items()):
        steps: dict[int, set[str]] = {}
        for ident, entry in sorted(entries.items()):
            res.items += 1
            listed[ident] = run
            if "unreadable" in entry:
                res.bad(f"run {run}: ledger entry {entry['unreadable']} is not JSON")
                continue
            _check_entry(res, store, run, ident, entry, snaps, rebuilt)
            if entry.get("content"):
                steps.setdefault(entry.get("step"), set()).add(entry["content"])
        for step, contents in sorted(steps.items(), key=lambda kv: str(kv[0])):
            if len(contents) > 1:
                res.bad(f"run {run}: step {step} was published with {len(contents)} different weights "
                        "(a step trained twice, or two publishers of one run)")
    publishing = _live_publishers(ctx)
    orphans = _orphans(store, snaps, listed)
    if orphans and publishing:
        res.notes.append(f"{len(orphans)} orphan candidates not judged: run(s) {sorted(publishing)} still publishing")
    else:
        for o in orphans:
            res.bad(o)
    return res


def _check_entry(res: CheckResult, store, run: str, ident: str, entry: dict, snaps: dict,  # noqa: ANN001
                 rebuilt: dict) -> None:
    where = f"run {run}: ledger entry {ident}"
    if entry.get("identity") != ident or entry.get("run") != run:
        res.bad(f"{where} names identity {entry.get('identity')} of run {entry.get('run')}")
    snap = snaps.get(ident)
    if snap is None:
        res.bad(f"{where}: the snapshot is missing from the store (no index)")
        return
    if (entry.get("kind"), entry.get("base")) != (snap.kind, snap.base):
        res.bad(f"{where} says {entry.get('kind')} on {entry.get('base')}, the stored index says {snap.kind} "
                f"on {snap.base}")
    for name, f in sorted((entry.get("files") or {}).items()):
        key = f"{ident}/{name}"
        if key not in store.sizes:
            res.bad(f"{where}: file {name} is missing from the store")
        elif store.sizes[key] != f.get("size") or xxhash.xxh3_128_hexdigest(store.get(key)) != f.get("xxh3_128"):
            res.bad(f"{where}: file {name} in the store is not the one the ledger recorded (size or xxh3-128)")
    version = rebuilt.get(ident)
    if version is None:
        return  # why is reported with the snapshot
    content = content_digest(version.tensors)
    if entry.get("content") is not None and entry["content"] != content:
        res.bad(f"{where}: the rebuilt version's content digest is {content}, the ledger records {entry['content']}")
    step = entry.get("step")
    if isinstance(step, int) and ident.startswith("step-"):
        want = expected_identity(run, step, snap.kind, snap.base, content)
        if want != ident:
            res.bad(f"{where}: run {run}, step {step}, {snap.kind} on {snap.base} with these weights is named "
                    f"{want}, not {ident} (the snapshot holds other weights than its name says)")


def _live_publishers(ctx: Context) -> set[str]:
    now = parse_time(ctx.soak.meta.get("ended_at")) or 0.0
    import time

    now = max(now, time.time())
    out = set()
    for key in ctx.store.sizes:
        m = RUN_KEY_RE.fullmatch(key)
        if m and m.group(2).startswith("leases/publish-"):
            try:
                expires = ctx.store.json(key).get("expires_at")
            except (ValueError, AttributeError):
                continue
            if isinstance(expires, (int, float)) and expires > now:
                out.add(m.group(1))
    return out


def _orphans(store, snaps: dict, listed: dict[str, str]) -> list[str]:  # noqa: ANN001
    out = []
    for folder, files in sorted(store.folders().items()):
        if folder not in snaps:
            out.append(f"orphan: folder {folder}/ holds {len(files)} file(s) and no index (a snapshot never "
                       "committed)")
        elif folder not in listed:
            out.append(f"orphan: snapshot {folder} is in the store but in no run's ledger")
    for key in sorted(store.sizes):
        if not key.startswith(BOOK):
            continue
        m = RUN_KEY_RE.fullmatch(key)
        if m and RUN_FILE_RE.fullmatch(m.group(2)):
            continue
        if any(r.fullmatch(key) for r in (HISTORY_KEY_RE, DEPLOYMENT_LEASE_RE, GC_LEASE_RE, EVAL_KEY_RE)):
            continue
        out.append(f"orphan: {key} is no part of the store's layout (docs/layout.md)")
    for key in store.open_uploads:
        out.append(f"orphan: an unfinished multipart upload of {key}")
    return out
