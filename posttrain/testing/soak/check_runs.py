"""Check 5, ``runs``: every run the soak started ended, Completed or ended by a fault it could not survive.

The state of each flow run of ``runs.jsonl`` (and of the operator's promote runs, in
``operator.jsonl``) is read from the Prefect API (``GET
/flow_runs/<id>``, plain HTTP). A run still Scheduled, Pending, Running, Paused or Cancelling after
the soak is a violation (nothing was left for a person to finish). A run that ended Failed,
Crashed or Cancelled passes only when an injected fault overlapped its life (from its start to
its end, ``GRACE_S`` either side) and the state's message names that fault's kind in its own
words (``FATAL``). The kinds that may end a run, and why:

- ``worker_kill``: its flow-run process dies with the worker; Prefect marks it Crashed and the
  sweeper (``posttrain recover``) retries it a bounded number of times (``--retries``, 3 by
  default; a run stuck Pending is set Crashed first): a run killed more often than that stays
  Crashed (its message: the process exited, or a lost heartbeat). A run Crashed with fewer
  sweeper retries in its state history (AwaitingRetry states whose message is the sweeper's) has
  not ended: it is a violation whatever its message (recovery without a person did not happen,
  or not before the soak gave up waiting).
- ``trainer_kill``: a training job killed with SIGKILL ends failed; a resident or nightly job is
  submitted again once, but a kill that takes the resubmitted job too fails the run (its message
  names the job's end: exit status, signal).
- ``store_outage``: the store's retries (``outage_retry``) cover an outage up to their budget; a
  longer one (the schedule goes to 120 s) fails a publish, a hot-load's fetch or the ledger
  (its message names the store, the endpoint or the connection).
- ``spool_full``: a full spool fails the publish step (ENOSPC, "No space left on device").
- ``serve_kill``: a hot-load into a deployment whose server is down fails once its retries are
  spent (its message names the hot-load or the deployment).
- not a fault: a promotion or rollback that meets another on production (the operator's, a nightly's
  ``promote_to``) loses at once and changes nothing (``OperationLost``: "is held by ...", or "its
  champion changed ..."), by design (one writer per deployment, docs/promotion.md). Such a run
  passes when another run or an operator action overlapped it (``lost_to``), and is counted in the notes.
- ``prefect_restart`` and ``postgres_restart``: the flow run cannot report its state while the API
  or its database is down; the run may end Crashed (its message names the API, the server or the
  database, or a lost heartbeat).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from posttrain.testing.soak.check_context import Context
from posttrain.testing.soak.check_model import CheckResult, finite, parse_time

GRACE_S = 30.0
CRASH_RETRIES = 3  # posttrain recover's default --retries (soak.json "crash_retries" overrides it)
SWEEPER_MARK = "posttrain recover:"  # how the sweeper's AwaitingRetry messages begin
TERMINAL_BAD = {"FAILED", "CRASHED", "CANCELLED"}
CRASH_WORDS = ("crash", "exited", "infrastructure", "heartbeat", "killed", "sigkill", "signal 9", "-9")
FATAL: dict[str, tuple[str, ...]] = {
    "worker_kill": CRASH_WORDS,
    "trainer_kill": CRASH_WORDS + ("job", "trainer", "exit status", "exit code", "returncode", "137", "requeue"),
    "store_outage": ("store", "s3", "outage", "503", "endpoint", "connection", "unreachable", "timed out",
                     "timeout", "refused", "slow down", "could not connect"),
    "spool_full": ("no space left", "enospc", "disk full", "spool", "errno 28"),
    "serve_kill": ("hot-load", "hotload", "hot load", "deployment", "connection refused", "unavailable", "serve"),
    "prefect_restart": CRASH_WORDS + ("prefect", "api", "server", "connection", "503", "500", "timed out"),
    "postgres_restart": CRASH_WORDS + ("database", "postgres", "sqlalchemy", "connection", "500", "503"),
}


def flow_run(api: str, flow_run_id: str, timeout: float = 15.0) -> dict:
    with urllib.request.urlopen(f"{api.rstrip('/')}/flow_runs/{flow_run_id}", timeout=timeout) as r:  # noqa: S310
        return json.loads(r.read())


def check_runs(ctx: Context) -> CheckResult:
    res = CheckResult("runs")
    runs = ctx.soak.records["runs"] + [  # the operator's promotions are flow runs the soak started too
        {"flow_run_id": a["flow_run_id"], "kind": "promote", "deployment": "operator", "night": "-",
         "started_at": a.get("at")} for a in ctx.soak.records["operator"]
        if a.get("action") == "promote" and a.get("flow_run_id")]
    res.items = len(runs)
    if not ctx.live:
        unfinished = set(ctx.soak.meta.get("unfinished_runs") or [])
        for r in runs:
            if r.get("flow_run_id") in unfinished:
                res.bad(f"run {r.get('flow_run_id')} did not end (soak.json unfinished_runs)")
            else:
                res.skipped.append(f"run {r.get('flow_run_id')}: its end state (not live)")
        return res
    api = ctx.soak.meta.get("prefect_api_url") or ""
    faults = [f for f in ctx.soak.records["faults"] if f.get("injected", True) is not False]
    for run in runs:
        rid = run.get("flow_run_id")
        what = f"{run.get('kind')} run {rid} ({run.get('deployment')}, night {run.get('night')})"
        try:
            fr = flow_run(api, str(rid))
        except (OSError, ValueError) as e:
            res.bad(f"{what}: its state cannot be read from {api} ({e})")
            continue
        state = fr.get("state") or {}
        kind = (state.get("type") or fr.get("state_type") or "?").upper()
        message = state.get("message") or ""
        if kind == "COMPLETED":
            continue
        if kind not in TERMINAL_BAD:
            res.bad(f"{what} did not end: {state.get('name') or kind} after the soak")
            continue
        retries = ctx.soak.meta.get("crash_retries", CRASH_RETRIES)
        if kind == "CRASHED":
            try:
                retried = sweeper_retries(api, str(rid))
            except (OSError, ValueError) as e:
                res.bad(f"{what}: its state history cannot be read from {api} ({e})")
                continue
            if finite(retried, retries) and retried < retries:
                res.bad(f"{what} is Crashed after {retried} retries without a person (the bound is {retries}): "
                        f"recovery without a person did not happen. {message[:200]!r}")
                continue
        start = parse_time(fr.get("start_time")) or parse_time(run.get("started_at"))
        end = parse_time(fr.get("end_time")) or parse_time(state.get("timestamp"))
        excuse = fatal_fault(faults, start, end, message) or lost_to(ctx, rid, start, end, message)
        if excuse is None:
            res.bad(f"{what} ended {state.get('name') or kind} with no injected fault that its message names: "
                    f"{message[:300]!r}")
        else:
            res.notes.append(f"{what} ended {state.get('name') or kind}, killed by {excuse}: {message[:200]!r}")
    return res


def sweeper_retries(api: str, flow_run_id: str, timeout: float = 15.0) -> int:
    """How many times the sweeper (``posttrain recover``) retried the run: the AwaitingRetry states of its
    history whose message is the sweeper's."""
    url = f"{api.rstrip('/')}/flow_run_states/?flow_run_id={flow_run_id}"
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310
        states = json.loads(r.read())
    return sum(1 for s in states if s.get("name") == "AwaitingRetry"
               and (s.get("message") or "").startswith(SWEEPER_MARK))


LOST = ("is held by", "champion changed")  # OperationLost: the promoter's own words


def lost_to(ctx: Context, flow_run_id: object, start: float | None, end: float | None, message: str) -> str | None:
    """A promotion (a nightly's ``promote_to``, an operator's promote) or rollback that lost production to
    another operation on it: ``OperationLost`` naming the holder or the changed champion, while an
    operator action or another run overlapped. One writer per deployment is the design
    (docs/promotion.md): the loser changes nothing and fails, naming who held it."""
    if "OperationLost" not in message or not any(w in message for w in LOST):
        return None
    holder = re.search(r"is held by promotion \S*?([0-9a-f]{8})-[0-9a-f-]+ ", message)
    if holder:  # the promotion holding it is one of the soak's runs (its run name ends in the flow run's id)
        for r in ctx.soak.records["runs"] + ctx.soak.records["operator"]:
            if str(r.get("flow_run_id") or "").startswith(holder.group(1)) and r.get("flow_run_id") != flow_run_id:
                return f"a concurrent promotion on production (run {r.get('flow_run_id')}; one writer per deployment)"
    others = [(r.get("started_at"), r.get("flow_run_id"), f"{r.get('kind')} run") for r in ctx.soak.records["runs"]
              if r.get("kind") != "grpo"]  # a GRPO run hot-loads its own deployment, never production
    others += [(a.get("at"), a.get("flow_run_id"), f"operator {a.get('action')}") for a in ctx.soak.records["operator"]
               if a.get("action") in ("rollback", "promote")]
    for at, other_id, what in others:
        t = parse_time(at)
        if other_id != flow_run_id and t is not None and (start is None or t >= start - GRACE_S) \
                and (end is None or t <= end + GRACE_S):
            return f"a concurrent operation on production ({what} at {at}; one writer per deployment)"
    return None


def fatal_fault(faults: list[dict], start: float | None, end: float | None, message: str) -> str | None:
    """The first injected fault that overlapped [start, end] and whose kind the message names."""
    text = message.lower()
    for f in faults:
        words = FATAL.get(f.get("kind") or "")
        if not words or not any(w in text for w in words):
            continue
        f_start, f_end = parse_time(f.get("started_at")), parse_time(f.get("ended_at"))
        if f_start is None:
            continue
        f_end = f_end if f_end is not None else f_start
        if (end is None or f_start <= end + GRACE_S) and (start is None or f_end >= start - GRACE_S):
            return f"{f.get('kind')} of {f.get('target')} at {f.get('started_at')}"
    return None
