"""Unattended recovery: a posttrain flow run that Prefect marks Crashed is retried, a bounded number of times.

Crashed is what Prefect sets when a run's process died without a word: the worker saw its
flow-run process exit (killed, out of memory), or the unresponsive-runs automation
(``unresponsive.py``) found its heartbeats stopped (a lost worker or login node). Such a run's
training job goes on, and a retried run finds it (the submit marker), so retrying is safe.

The retry is the one ``prefect flow-run retry`` and the UI's Retry make, done by an automation:
on the ``prefect.flow-run.Crashed`` event of a run tagged ``posttrain``, the run is set to a
Scheduled state named ``AwaitingRetry`` (Crashed to Scheduled is allowed for a deployment's run;
a worker picks it up, keeping the run's id and parameters, its ``run_count`` one more).

The bound is Prefect's own count: every flow-run state event carries the run's
``prefect.run-count`` (how many times it has entered Running), and the trigger matches only
counts 1 to ``retries``. So a run that crashes on its (``retries`` + 1)th attempt stays Crashed,
for a person (docs/recovery.md). A run that crashed before it ever ran (count 0: its
infrastructure did not start) is not retried either: a retry would meet the same fault forever.

Visibility: the AwaitingRetry state's message says who retried it and the bound; each retry is
a ``prefect.automation.action.executed`` event whose resource is this automation and whose related
resources include the flow run (role ``target``), besides the run's ``prefect.flow-run.AwaitingRetry``.
"""

from __future__ import annotations

AUTOMATION_NAME = "posttrain-retry-crashed-runs"
DEFAULT_RETRIES = 3
MAX_RETRIES = 20  # a run that crashes more than this needs a person, whatever the site says
TAG = "posttrain"  # every deployment in prefect.yaml carries it


def check_retries(retries: int) -> int:
    """``retries``, or a ``ValueError`` saying why it cannot be: 0 (no automatic retries: the
    automation is installed disabled) to ``MAX_RETRIES``."""
    if not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"{retries}: it must be from 0 (never retry a Crashed run without a person) to "
                         f"{MAX_RETRIES} retries of one run (the default is {DEFAULT_RETRIES})")
    return retries


def retry_message(retries: int) -> str:
    return (f"Crashed (a lost worker or a killed flow-run process): retried by the automation {AUTOMATION_NAME}, "
            f"at most {retries} times per run; the retried run finds its training job.")


def crashed_runs_automation(retries: int = DEFAULT_RETRIES):
    """The automation (not saved): a Crashed run of attempt 1..``retries`` is set AwaitingRetry."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    check_retries(retries)
    counts = [str(n) for n in range(1, retries + 1)] or ["1"]  # disabled when 0: the list only has to be valid
    return Automation(
        name=AUTOMATION_NAME,
        description=(f"Retry a posttrain flow run that Prefect marked Crashed, the way Retry does (AwaitingRetry), "
                     f"on its attempts 1 to {retries}; a later crash is left for a person (docs/recovery.md)."),
        enabled=retries > 0,
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*", "prefect.run-count": counts}),
            match_related=ResourceSpecification({"prefect.resource.role": "tag",
                                                 "prefect.resource.id": f"prefect.tag.{TAG}"}),
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry", message=retry_message(retries))],
    )


def install_crashed_runs_automation(retries: int = DEFAULT_RETRIES) -> str:
    """Create the automation, or update the one of the same name (idempotent); returns its id."""
    from prefect.automations import Automation

    wanted = crashed_runs_automation(retries)
    try:
        existing = Automation.read(name=AUTOMATION_NAME)
    except ValueError:  # Prefect's "not found"
        existing = None
    if existing is None:
        return str(wanted.create().id)
    wanted.id = existing.id
    wanted.update()
    return str(existing.id)
