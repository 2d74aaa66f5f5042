"""Unattended recovery: ``posttrain recover`` retries Crashed posttrain flow runs, a bounded number of times.

Crashed is what Prefect sets when a run's process died without a word: the worker saw its
flow-run process exit (killed, out of memory), or the unresponsive-runs automation
(``unresponsive.py``) found its heartbeats stopped (a lost worker or login node). Such a run's
training job goes on, and a retried run finds it (the submit marker), so retrying is safe.

Why a sweep and not an automation: a reactive automation on ``prefect.flow-run.Crashed`` is
evaluated only once Prefect has seen the event the Crashed event follows (the run's Running
event, when it came less than 5 minutes before); a server restarted in between never saw it and
holds the Crashed event for 15 minutes, or loses it (the chaos soak, seed 1, docs/reliability.md).
And when such a held event is finally acted on, the run may have been retried and be Running or
Completed again: the automation would schedule it once more. The sweep instead reads each run's
state as it is now, and acts only on a run whose state is still the one it read.

Each sweep, for the runs tagged ``posttrain``:

- a run **Crashed** (in the last ``lookback_h`` hours, of a deployment) that this sweep retried
  fewer than ``retries`` times is set ``AwaitingRetry``, the state ``prefect flow-run retry`` and
  the UI's Retry set; a worker picks it up, keeping its id and parameters. Past the bound it is
  left Crashed and a ``posttrain.flow-run.left-crashed`` event says so (an automation notifies a
  person: docs/recovery.md);
- a run **Pending** for ``pending_timeout_s`` (its worker submitted it, and its flow-run process
  never reported Running: killed while it started, or the database was down) is set Crashed,
  which frees its deployment's concurrency slot; the next sweep retries it;
- a run **Running** (of a deployment) whose newest ``prefect.flow-run.heartbeat`` event, or its
  Running state when it sent none, is older than ``heartbeat_timeout_s`` is set Crashed, and the
  next sweep retries it. This is the unresponsive-runs automation's rule (``unresponsive.py``), read
  from the stored events instead of held in a reactive trigger: a server restarted within the
  timeout of a run's death forgot the trigger's clock, and the run stayed Running for ever, holding
  its deployment's slot (the chaos soak, seed 1, 2026-12-07: a flow-run process killed a second
  after it started, the server restarted 18 s later). Heartbeats cannot land while the API is
  down, so the rule waits until this sweeper has reached the API for a whole timeout without a
  failed sweep (and for that long after it starts).

Each retry is a state in the run's history (``AwaitingRetry``, its message beginning
``RETRY_MARK``) and a ``posttrain.flow-run.retried`` event. The count of those states is the bound's
count, kept by Prefect and not by this process, so a restarted sweeper knows it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.pipeline.deployments.unresponsive import DEFAULT_TIMEOUT_S, HEARTBEAT_FREQUENCY_S


RETRY_MARK = "posttrain recover:"
# the automation an earlier posttrain installed instead; prefect-setup deletes it, and its retries count
OLD_AUTOMATION = "posttrain-retry-crashed-runs"
DEFAULT_RETRIES = 3
DEFAULT_HEARTBEAT_TIMEOUT_S = float(DEFAULT_TIMEOUT_S)  # the unresponsive-runs automation's: three missed heartbeats
HEARTBEAT = "prefect.flow-run.heartbeat"
MAX_RETRIES = 20  # a run that crashes more than this needs a person, whatever the site says
TAG = "posttrain"  # every deployment in prefect.yaml carries it
PAGE = 200


class RecoveryConfig(BaseModel):
    """What ``posttrain recover`` retries, and how often it looks."""

    model_config = ConfigDict(extra="forbid")

    retries: int = Field(DEFAULT_RETRIES, ge=0, le=MAX_RETRIES,
                         description="retries of one Crashed run without a person (0: never; a person retries)")
    pending_timeout_s: float = Field(600.0, gt=0,
                                     description="seconds a run may stay Pending (its flow-run process starting) "
                                                 "before it is set Crashed")
    heartbeat_timeout_s: float = Field(DEFAULT_HEARTBEAT_TIMEOUT_S, ge=0,
                                       description="seconds a Running run may go without a heartbeat before it is "
                                                   "set Crashed (0: never; work pools without heartbeats)")
    every_s: float = Field(30.0, gt=0, description="seconds between two sweeps")
    lookback_h: float = Field(24.0, gt=0, description="Crashed runs that ended longer ago are left alone")
    tag: str = Field(TAG, min_length=1, description="only flow runs with this tag are swept")

    @field_validator("pending_timeout_s", "every_s", "lookback_h", "heartbeat_timeout_s")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number of seconds or hours")
        return value

    @field_validator("heartbeat_timeout_s")
    @classmethod
    def _beyond_heartbeats(cls, value: float) -> float:
        if value != 0 and value <= HEARTBEAT_FREQUENCY_S:
            raise ValueError(f"must be 0 (off) or longer than the {HEARTBEAT_FREQUENCY_S} s between a run's heartbeats, "
                             "or every healthy run would be set Crashed")
        return value

    @model_validator(mode="after")
    def _sweeps_see_outages(self) -> RecoveryConfig:
        # an API outage between two sweeps goes unseen, and the heartbeats sent meanwhile are lost: with
        # three sweeps per timeout an unseen outage costs a run one heartbeat at most
        if self.heartbeat_timeout_s and self.every_s > self.heartbeat_timeout_s / 3:
            raise ValueError(f"every_s: {self.every_s:g} s is more than a third of heartbeat_timeout_s "
                             f"({self.heartbeat_timeout_s:g} s): sweep more often, or set heartbeat_timeout_s 0")
        return self


@dataclass(frozen=True)
class Action:
    """What one sweep did to one run."""

    flow_run_id: str
    flow_run_name: str
    did: str  # "retried", "crashed", "left"
    detail: str


def our_retries(states: list[Any]) -> int:
    """How many times the run was retried without a person: its AwaitingRetry states set by a sweep
    (or by the automation an earlier posttrain installed)."""
    return sum(1 for s in states if s.name == "AwaitingRetry"
               and ((s.message or "").startswith(RETRY_MARK) or OLD_AUTOMATION in (s.message or "")))


def _age_s(state: Any, now: datetime) -> float:
    return (now - state.timestamp).total_seconds()


async def _runs(client: Any, cfg: RecoveryConfig, state_type: Any, ended_after: datetime | None) -> list[Any]:
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterEndTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )

    flt = FlowRunFilter(tags=FlowRunFilterTags(all_=[cfg.tag]),
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[state_type])),
                        end_time=FlowRunFilterEndTime(after_=ended_after) if ended_after else None)
    found, offset = [], 0
    while True:
        page = await client.read_flow_runs(flow_run_filter=flt, limit=PAGE, offset=offset)
        found += page
        if len(page) < PAGE:
            return found
        offset += PAGE


def _emit(event: str, run: Any, payload: dict) -> None:
    from prefect.events import emit_event

    emit_event(event=event, resource={"prefect.resource.id": f"prefect.flow-run.{run.id}",
                                      "prefect.resource.name": run.name},
               related=[{"prefect.resource.id": f"prefect.tag.{t}", "prefect.resource.role": "tag"}
                        for t in run.tags],
               payload=payload)


async def _still(client: Any, run: Any) -> Any | None:
    """The run as it is now, or None when its state is no longer the one the sweep read."""
    now_run = await client.read_flow_run(run.id)
    return now_run if now_run.state is not None and now_run.state.id == run.state.id else None


async def _crash(client: Any, run: Any, message: str) -> Action | None:
    """Set ``run`` Crashed with ``message``, if it is still in the state the sweep read."""
    from prefect.states import Crashed

    if await _still(client, run) is None:
        return None
    result = await client.set_flow_run_state(run.id, Crashed(message=message), force=False)
    if result.status.value != "ACCEPT":
        return None
    return Action(str(run.id), run.name, "crashed", message)


async def _crash_stuck(client: Any, run: Any, cfg: RecoveryConfig) -> Action | None:
    return await _crash(client, run, f"{RETRY_MARK} Pending for more than {cfg.pending_timeout_s:.0f} s: its flow-run "
                                     "process never reported Running (killed while it started, or the API or its "
                                     "database was down)")


async def _last_heartbeat(client: Any, run: Any, now: datetime) -> datetime | None:
    """When the run's newest stored heartbeat occurred (since its Running state), or None."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    page = await client.read_events(filter=EventFilter(
        occurred=EventOccurredFilter(since=run.state.timestamp - timedelta(seconds=5), until=now + timedelta(minutes=1)),
        event=EventNameFilter(name=[HEARTBEAT]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{run.id}"]),
    ), limit=1)  # newest first: the filter's default order
    return max((e.occurred for e in page.events), default=None)


async def _crash_silent(client: Any, run: Any, cfg: RecoveryConfig, now: datetime) -> Action | None:
    """Set Crashed a Running run that sent no heartbeat for ``heartbeat_timeout_s``."""
    last = await _last_heartbeat(client, run, now)
    silent = (now - (last or run.state.timestamp)).total_seconds()
    if silent < cfg.heartbeat_timeout_s:
        return None
    what = f"its last heartbeat was {silent:.0f} s ago" if last else f"it sent none in {silent:.0f} s Running"
    return await _crash(client, run, f"{RETRY_MARK} No heartbeat for {cfg.heartbeat_timeout_s:.0f} s ({what}): its "
                                     "flow-run process or the worker running it was lost. It can be retried: the "
                                     "retried run finds its job.")


async def _retry(client: Any, run: Any, cfg: RecoveryConfig, left: set) -> Action | None:
    from prefect.states import AwaitingRetry

    done = our_retries(await client.read_flow_run_states(run.id))
    crash = " ".join((run.state.message or "no message").split())[:300]
    if done >= cfg.retries:
        if run.state.id in left:
            return None
        left.add(run.state.id)
        detail = f"Crashed after {done} retries without a person (the bound is {cfg.retries}): {crash}"
        _emit("posttrain.flow-run.left-crashed", run, {"retries": done, "bound": cfg.retries, "message": crash})
        return Action(str(run.id), run.name, "left", detail)
    if await _still(client, run) is None:
        return None
    message = (f"{RETRY_MARK} retry {done + 1} of at most {cfg.retries} without a person; it had Crashed: {crash}")
    result = await client.set_flow_run_state(run.id, AwaitingRetry(message=message), force=False)
    if result.status.value != "ACCEPT":
        return None
    _emit("posttrain.flow-run.retried", run, {"retry": done + 1, "bound": cfg.retries, "crashed": crash})
    return Action(str(run.id), run.name, "retried", message)


async def sweep(client: Any, cfg: RecoveryConfig, left: set | None = None, api_up_s: float = math.inf) -> list[Action]:
    """One sweep (see the module's docstring); ``left`` remembers the Crashed states already reported
    as left for a person, so each is reported once per sweeper; ``api_up_s``: how long the API has
    answered every sweep (the heartbeat rule waits for a whole timeout of it)."""
    from prefect.client.schemas.objects import StateType

    left = set() if left is None else left
    now = datetime.now(timezone.utc)
    actions: list[Action | None] = []
    for run in await _runs(client, cfg, StateType.PENDING, None):
        if run.state is not None and _age_s(run.state, now) >= cfg.pending_timeout_s:
            actions.append(await _crash_stuck(client, run, cfg))
    if cfg.heartbeat_timeout_s > 0 and api_up_s >= cfg.heartbeat_timeout_s:
        for run in await _runs(client, cfg, StateType.RUNNING, None):
            if (run.deployment_id is not None and run.state is not None
                    and _age_s(run.state, now) >= cfg.heartbeat_timeout_s):
                actions.append(await _crash_silent(client, run, cfg, now))
    if cfg.retries > 0:
        for run in await _runs(client, cfg, StateType.CRASHED, now - timedelta(hours=cfg.lookback_h)):
            if run.deployment_id is not None and run.state is not None:  # Prefect retries only a deployment's run
                actions.append(await _retry(client, run, cfg, left))
    return [a for a in actions if a is not None]


async def run(cfg: RecoveryConfig, *, once: bool = False, say=print) -> None:
    """Sweep every ``cfg.every_s`` seconds until killed (once with ``once``). A sweep that cannot reach
    the API (a server or database restarting) is reported and the next one tries again: the
    sweeper must outlive what it recovers from."""
    import asyncio

    from prefect.client.orchestration import get_client

    left: set = set()
    up_since = time.monotonic()  # heartbeats sent before this sweeper watched may not have landed
    while True:
        try:
            async with get_client() as client:
                # --once has watched nothing: no heartbeat rule (a run is not set Crashed on one look)
                up_s = 0.0 if once else time.monotonic() - up_since
                for action in await sweep(client, cfg, left, api_up_s=up_s):
                    say(f"{action.did} {action.flow_run_name} ({action.flow_run_id}): {action.detail}")
        except Exception as e:  # noqa: BLE001 - the API or its database away: try again at the next sweep
            if once:
                raise
            up_since = time.monotonic()
            say(f"sweep failed, trying again in {cfg.every_s:.0f} s: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        if once:
            return
        await asyncio.sleep(cfg.every_s)


def delete_old_automation() -> bool:
    """Delete the automation an earlier posttrain installed to retry Crashed runs (a held Crashed
    event it acted on late could schedule a run already retried); whether there was one."""
    from prefect.automations import Automation

    try:
        old = Automation.read(name=OLD_AUTOMATION)
    except ValueError:  # Prefect's "not found"
        return False
    return bool(old.delete())
