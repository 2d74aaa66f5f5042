"""Lost-worker recovery the Prefect way: a run whose heartbeats stop is marked Crashed.

A flow run started by a worker emits a ``prefect.flow-run.heartbeat`` event every
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (prefect.yaml's work pool sets 30, Prefect's
minimum). When the worker, or the login node it runs on, is lost, the heartbeats stop but the run
stays Running, and Prefect refuses to retry a Running run. This automation (Prefect's documented
"zombie flow" recipe, limited to runs tagged ``posttrain``) marks such a run Crashed once no
heartbeat or final state has come for ``timeout`` seconds after its last heartbeat. From Crashed,
``posttrain recover`` (``recovery.py``) retries it without a person (a bounded number of times),
as ``prefect flow-run retry`` and the UI's Retry do, and the retried run finds its job on the
cluster (still running, or finished) instead of submitting another.
"""

from __future__ import annotations

from datetime import timedelta

AUTOMATION_NAME = "posttrain-crash-unresponsive-runs"
DEFAULT_TIMEOUT_S = 90  # three missed heartbeats at Prefect's minimum frequency (30 s)
HEARTBEAT_FREQUENCY_S = 30
TAG = "posttrain"  # every deployment in prefect.yaml carries it


def check_timeout(timeout_s: int) -> int:
    """``timeout_s``, or a ``ValueError`` saying why it cannot be: it must exceed the heartbeat
    frequency (a shorter one marks every healthy run Crashed between two heartbeats). There is no
    "off": the automation is what lets a lost worker's run be retried."""
    if timeout_s <= HEARTBEAT_FREQUENCY_S:
        raise ValueError(f"{timeout_s} s: it must be longer than the {HEARTBEAT_FREQUENCY_S} s between a run's "
                         "heartbeats, or every healthy run would be marked Crashed (the default is "
                         f"{DEFAULT_TIMEOUT_S} s)")
    return timeout_s


def unresponsive_runs_automation(timeout_s: int = DEFAULT_TIMEOUT_S):
    """The automation (not saved): Crashed after ``timeout_s`` seconds without a heartbeat."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    check_timeout(timeout_s)
    return Automation(
        name=AUTOMATION_NAME,
        description=(f"Mark a posttrain flow run Crashed when its heartbeats stop for {timeout_s} s (a lost worker "
                     "or login node), so that it can be retried; the retry finds its job."),
        enabled=True,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Cancelling", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "tag",
                                                 "prefect.resource.id": f"prefect.tag.{TAG}"}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=timeout_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"No heartbeat for {timeout_s} s: the worker running this flow run "
                                            "was lost. It can be retried: the retried run finds its job.")],
    )


def install_unresponsive_runs_automation(timeout_s: int = DEFAULT_TIMEOUT_S) -> str:
    """Create the automation, or update the one of the same name (idempotent); returns its id."""
    from prefect.automations import Automation

    wanted = unresponsive_runs_automation(timeout_s)
    try:
        existing = Automation.read(name=AUTOMATION_NAME)
    except ValueError:  # Prefect's "not found"
        existing = None
    if existing is None:
        return str(wanted.create().id)
    wanted.id = existing.id
    wanted.update()
    return str(existing.id)
