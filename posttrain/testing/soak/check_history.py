"""Check 2, ``histories``: every promotion history is consistent, and production serves its champion.

- every history in the store replays without a problem (``check_replay``: numbering, each
  record's previous, decisions, reverted records, retries recording nothing twice);
- every identity the history needs kept (what promotions and rollbacks switched to, and every
  champion a record replaced or kept) is still a whole snapshot in the store: gc must keep them
  (docs/retention.md), and a rollback needs them;
- no deployment lease is left with ``pending`` set (production may not serve the champion);
- after quiescence each production gateway serves the history's champion (none: the boot
  weights, which name no identity), by every witness there is: its live ``/health`` when it still
  runs, its ``/health`` as the driver read it at quiesce (soak.json ``final``; the gateways are
  stopped at the end), and its own ``state.json`` (what a restart would serve);
- every operator ``rollback`` that exited 0 left a rollback record of the operator (``run`` null)
  in that deployment's history, and there are no more such records than the operator's attempts.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from posttrain.testing.soak.check_context import Context
from posttrain.testing.soak.check_model import CheckResult
from posttrain.testing.soak.check_store import DEPLOYMENT_LEASE_RE


def check_histories(ctx: Context) -> CheckResult:
    res = CheckResult("histories")
    histories = ctx.histories
    for dep, rep in histories.items():
        res.items += len(rep.records) or 1
        for p in rep.problems:
            res.bad(p)
        res.notes += rep.notes
        for ident, why in sorted(rep.kept.items()):
            if ident not in ctx.snapshots:
                res.bad(f"history of {dep}: {ident} (needed by record {why}) is not in the store")
            elif ident not in ctx.rebuilt[0]:
                res.bad(f"history of {dep}: {ident} (needed by record {why}) cannot be rebuilt from the store")
    for key in sorted(ctx.store.sizes):
        m = DEPLOYMENT_LEASE_RE.fullmatch(key)
        if m:
            try:
                pending = ctx.store.json(key).get("pending")
            except (ValueError, AttributeError):
                pending = None
            if pending:
                res.bad(f"deployment {m.group(1)}: its lease is left with pending={pending} (a switch never "
                        "finished; production may not serve the history's champion)")
    for role, entry in sorted(ctx.soak.productions().items()):
        dep, prefix = ctx.soak.history_of(entry, role)
        rep = histories.get(dep)
        if (prefix.strip("/") or "") != (ctx.soak.store.get("prefix") or "").strip("/"):
            res.bad(f"{role}: its history is under prefix {prefix!r}, not the soak store's; not read")
            continue
        champion = rep.champion if rep is not None else None
        res.items += 1
        _check_served(ctx, res, role, entry, dep, champion)
        _check_operator(ctx, res, dep, rep)
    return res


def gateway_get(ctx: Context, entry: dict, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """GET a gateway path with the soak's token; (status, body)."""
    url = (entry.get("gateway_url") or "").rstrip("/") + path
    req = urllib.request.Request(url)
    token_env = ctx.soak.meta.get("gateway_token_env")
    if token_env and os.environ.get(token_env):
        req.add_header("Authorization", f"Bearer {os.environ[token_env]}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the soak's own gateway
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def served_observations(ctx: Context, role: str, entry: dict) -> tuple[dict[str, str | None], list[str]]:
    """What production serves after the soak, as each witness saw it: the live gateway's /health
    (when ``live`` and it answers), its /health as the driver read it at quiesce (``final``), and the
    gateway's own ``state.json`` in its work folder (what a restart resumes). Missing witnesses are
    listed as problems; a witness is a dict entry source -> identity (None: the boot weights)."""
    seen: dict[str, str | None] = {}
    problems: list[str] = []
    if ctx.live and entry.get("gateway_url"):
        try:
            status, body = gateway_get(ctx, entry, "/health")
            if status == 200:
                seen["live /health"] = json.loads(body).get("snapshotIdentity")
        except (OSError, ValueError, AttributeError):
            pass  # stopped at the end of the soak: the driver's reading at quiesce stands in
    final = (entry.get("final") or {}).get("health")
    if isinstance(final, dict) and "snapshotIdentity" in final:
        seen["/health at quiesce"] = final.get("snapshotIdentity")
    elif not seen:
        live = "unreachable" if ctx.live else "not asked (offline)"
        problems.append(f"{role}: no reading of its /health after the soak (live: {live}; at quiesce: {final!r})")
    work = entry.get("work_dir")
    if work:
        try:
            state = json.loads((Path(work) / "state.json").read_text())
            seen["state.json"] = state.get("identity")
        except FileNotFoundError:
            seen["state.json"] = None  # never hot-loaded: the boot weights
        except (OSError, ValueError, AttributeError) as e:
            problems.append(f"{role}: {work}/state.json cannot be read ({e})")
    return seen, problems


def _check_served(ctx: Context, res: CheckResult, role: str, entry: dict, dep: str, champion: str | None) -> None:
    seen, problems = served_observations(ctx, role, entry)
    for p in problems:
        res.bad(p)
    for source, served in sorted(seen.items()):
        if served != champion:
            res.bad(f"{role} ({dep}) serves {served or 'the boot weights'} ({source}), its history's champion is "
                    f"{champion or 'none (the boot weights)'}")


def _operator_deployment(argv: list) -> str | None:
    for i, a in enumerate(argv):
        if a == "--deployment" and i + 1 < len(argv):
            return str(argv[i + 1])
        if isinstance(a, str) and a.startswith("--deployment="):
            return a.split("=", 1)[1]
    return None


def _check_operator(ctx: Context, res: CheckResult, dep: str, rep) -> None:  # noqa: ANN001 - a Replay
    actions = [a for a in ctx.soak.records["operator"] if a.get("action") == "rollback"
               and _operator_deployment(a.get("argv") or []) in (dep, None)
               and "--dry-run" not in (a.get("argv") or [])]
    if not actions:
        return
    res.items += len(actions)
    ok = sum(1 for a in actions if a.get("rc") == 0)
    recorded = [r for r in (rep.records if rep is not None else []) if r.get("kind") == "rollback" and r.get("run") is None]
    if len(recorded) < ok:
        res.bad(f"{dep}: the operator's rollback exited 0 {ok} times, its history has {len(recorded)} operator "
                "rollback records")
    if len(recorded) > len(actions):
        res.bad(f"{dep}: {len(recorded)} operator rollback records, but the operator rolled back only "
                f"{len(actions)} times")
