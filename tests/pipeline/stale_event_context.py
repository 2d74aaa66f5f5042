"""Run as a script by test_event_context.py, in a fresh process against the Prefect server: Prefect's
events worker is started inside a task run of a first flow run (as happens when it was drained and
the next event came from a task), then a second flow run emits a posttrain event from its body.
Prints the second flow run's id."""

from __future__ import annotations

from prefect import flow, task
from prefect.context import FlowRunContext
from prefect.events.worker import EventsWorker

from posttrain.pipeline.tasks import events


@task(name="submit-earlier")
def submit_earlier() -> None:
    EventsWorker.drain_all()  # the next event starts a new worker, here, inside this task run
    events.round_finished("earlier-run", 0, 1, 0.5, 0.0, "run-step-1")


@flow(name="earlier-flow")
def earlier_flow() -> None:
    submit_earlier()


@flow(name="later-flow")
def later_flow() -> str:
    events.round_finished("later-run", 0, 1, 0.5, 0.0, "run-step-1")
    return str(FlowRunContext.get().flow_run.id)


if __name__ == "__main__":
    earlier_flow()
    print(later_flow())
