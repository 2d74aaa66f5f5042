"""Prefect events of a run: one function per event, so a flow or task emits each in one line.

Events (``prefect.events.emit_event``), their primary resource, and what they carry:

- ``posttrain.snapshot.published``: ``posttrain.snapshot.<identity>``; step, kind (full/delta),
  stored and uploaded bytes; related: the run and the store block.
- ``posttrain.hotload.succeeded`` / ``posttrain.hotload.failed``: the inference deployment block
  ``posttrain.block.<slug>.<name>`` (label ``posttrain.snapshot``: the identity); seconds, fallback,
  or the error (type and message, the block's token masked) and whether the task retries it
  (label ``posttrain.will-retry``: ``true``/``false``); related: the snapshot and the run.
- ``posttrain.round.finished``: the run ``posttrain.run.<run_name>`` (label ``posttrain.round``);
  samples, reward mean and std; related: the round's snapshot.
- ``posttrain.promotion.accepted`` / ``posttrain.promotion.refused``: the production deployment block
  (label ``posttrain.snapshot``: the candidate); the decision (rule, margin, confidence, both means,
  the lower bound, prompts, n, reason) and the history record's number; related: the candidate,
  the champion and the run.
- ``posttrain.rollback.done``: the production deployment block (label ``posttrain.snapshot``: the
  version served again); the previous champion, the record's number and the reason.
- ``posttrain.run.goodput``: the run ``posttrain.run.<run_name>``, at the end of a nightly or GRPO run;
  every figure of ``posttrain.runs.goodput.Goodput`` (wall time, seconds per category, goodput,
  attempts, restarts, work redone) and goodput_percent.
- ``posttrain.job.submitted`` / ``completed`` / ``failed`` / ``cancelled``: the training job
  ``posttrain.job.<backend>.<job_id>``; job id, backend, run name (and the reason of a failure or
  cancellation); related: the run.

Emitted inside a flow or task run, Prefect adds the flow run, task run, flow and deployment as
related resources. Events that state a fact once (a snapshot published, a job's submission and
its end) carry an id derived from what they describe, so a retried flow run reporting it again
records no second event (the server ignores an event id it has).
"""

from __future__ import annotations

import contextvars
import uuid
from typing import Any

from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event

from posttrain import redact
from posttrain.runs.once import JobRecord

_NAMESPACE = uuid.UUID("5d0c0f5e-6b1e-4f4c-9d7a-0c2f3b8a7e11")  # event ids of facts stated once
ERROR_MAX = 2000  # characters of an error message an event carries


def run_resource(run_name: str, role: str = "run") -> dict[str, str]:
    return {"prefect.resource.id": f"posttrain.run.{run_name}", "prefect.resource.name": run_name,
            "prefect.resource.role": role}


def snapshot_resource(identity: str, role: str | None = None) -> dict[str, str]:
    found = {"prefect.resource.id": f"posttrain.snapshot.{identity}", "prefect.resource.name": identity}
    return found | ({"prefect.resource.role": role} if role else {})


def block_resource(ref: str, role: str | None = None) -> dict[str, str]:
    """A block named ``<slug>/<name>`` (as the run settings name it)."""
    found = {"prefect.resource.id": "posttrain.block." + ref.replace("/", "."), "prefect.resource.name": ref}
    return found | ({"prefect.resource.role": role} if role else {})


def job_resource(job: JobRecord) -> dict[str, str]:
    return {"prefect.resource.id": f"posttrain.job.{job.backend}.{job.job_id}", "prefect.resource.name": job.name,
            "posttrain.backend": job.backend}


def job_run_name(job: JobRecord) -> str:
    """The run a job belongs to: its output folder lies in the run folder (``<shared>/runs/<run_name>``)."""
    return job.output_dir.rstrip("/").rsplit("/", 2)[-2]


def _once(*parts: object) -> uuid.UUID:
    return uuid.uuid5(_NAMESPACE, "/".join(str(p) for p in parts))


def _emit(event: str, resource: dict[str, str], related: list[dict[str, str]], payload: dict[str, Any],
          id: uuid.UUID | None = None) -> None:
    # Prefect's events worker attaches the run's related resources in its own thread, with only the
    # context variables that are *set* where the event was emitted laid over its own context, which
    # is the one it was started in. Started inside a task run (an earlier run's submit-…), that task
    # run stayed in it, and every later event emitted outside a task (a GRPO run's round.finished,
    # job.completed, run.goodput) named it as related. Both run contexts are set here, None outside
    # a run, so the worker sees exactly this event's.
    contextvars.copy_context().run(_emit_here, event, resource, related, payload, id)


def _emit_here(event: str, resource: dict[str, str], related: list[dict[str, str]], payload: dict[str, Any],
               id: uuid.UUID | None) -> None:
    for run_context in (FlowRunContext, TaskRunContext):
        run_context.__var__.set(run_context.get())
    emit_event(event, resource=resource, related=related, payload=payload, id=id)


def snapshot_published(run_name: str, store: str, snapshot, publish_lag_seconds: float | None = None) -> None:
    """``snapshot``: a ``posttrain.publish.PublishedSnapshot``; ``publish_lag_seconds``: from the checkpoint's
    save to its publication, when known."""
    resource = snapshot_resource(snapshot.identity) | {"posttrain.kind": snapshot.kind,
                                                       "posttrain.step": str(snapshot.step)}
    payload = {"run_name": run_name, "step": snapshot.step, "kind": snapshot.kind, "base": snapshot.base,
               "stored_bytes": snapshot.stored_bytes, "uploaded_bytes": snapshot.uploaded_bytes, "store": store,
               "publish_lag_seconds": None if publish_lag_seconds is None else round(publish_lag_seconds, 3)}
    _emit("posttrain.snapshot.published", resource, [run_resource(run_name), block_resource(store, "store")],
          payload, id=_once("posttrain.snapshot.published", run_name, snapshot.identity))


def _deployment(inference: str, identity: str, deployment_id: str | None, **labels: str) -> dict[str, str]:
    resource = block_resource(inference) | {"posttrain.snapshot": identity}
    return resource | ({"posttrain.deployment-id": deployment_id} if deployment_id else {}) | labels


def hotload_succeeded(run_name: str, inference: str, identity: str, result, deployment_id: str | None = None) -> None:
    """``identity``: the snapshot asked for; ``result``: the ``HotLoadResult`` (what is served now)."""
    payload = {"run_name": run_name, "inference": inference, "requested": identity, "identity": result.identity,
               "fell_back": result.fell_back, "seconds": round(result.seconds, 3),
               "snapshot_type": result.snapshot_type}
    related = [snapshot_resource(result.identity, "snapshot"), run_resource(run_name)]
    if result.identity != identity:
        related.append(snapshot_resource(identity, "requested-snapshot"))
    _emit("posttrain.hotload.succeeded", _deployment(inference, result.identity, deployment_id), related, payload)


def hotload_failed(run_name: str, inference: str, identity: str, error: BaseException, *, will_retry: bool,
                   deployment_id: str | None = None, secrets: tuple[str, ...] = ()) -> None:
    """The error's message with every string of ``secrets`` and every known secret masked
    (``redact.scrub``), at most ERROR_MAX characters."""
    message = redact.scrub(error, secrets)
    payload = {"run_name": run_name, "inference": inference, "identity": identity,
               "error_type": type(error).__name__, "error": message[:ERROR_MAX], "will_retry": will_retry}
    resource = _deployment(inference, identity, deployment_id, **{"posttrain.will-retry": str(will_retry).lower()})
    _emit("posttrain.hotload.failed", resource, [snapshot_resource(identity, "snapshot"), run_resource(run_name)],
          payload)


def round_finished(run_name: str, round: int, samples: int, reward_mean: float, reward_std: float,
                   identity: str) -> None:
    resource = run_resource(run_name) | {"posttrain.round": str(round)}
    resource.pop("prefect.resource.role")
    payload = {"run_name": run_name, "round": round, "samples": samples, "reward_mean": reward_mean,
               "reward_std": reward_std, "snapshot": identity}
    _emit("posttrain.round.finished", resource, [snapshot_resource(identity, "snapshot")], payload)


def run_goodput(run_name: str, goodput) -> None:
    """``goodput``: a ``posttrain.runs.goodput.Goodput``; the payload carries every figure of it."""
    resource = run_resource(run_name)
    resource.pop("prefect.resource.role")
    payload = {"run_name": run_name, **goodput.model_dump(), "goodput_percent": round(100 * goodput.goodput, 2)}
    _emit("posttrain.run.goodput", resource, [], payload)


def job_event(state: str, job: JobRecord, reason: str | None = None,
              related: list[dict[str, str]] | None = None) -> None:
    """``posttrain.job.<state>``: submitted, completed, failed or cancelled (``reason``: why it failed, or
    how it was stopped)."""
    run_name = job_run_name(job)
    payload = {"job_id": job.job_id, "backend": job.backend, "run_name": run_name, "job_name": job.name,
               "log_path": job.log_path}
    if reason is not None:
        payload["reason"] = redact.scrub(reason)[:ERROR_MAX]
    event = f"posttrain.job.{state}"
    _emit(event, job_resource(job), [run_resource(run_name), *(related or [])], payload,
          # the submission's own run id too: a cluster's job ids start again (a Slurm whose state
          # was reset), and the server would keep an earlier job's event under the same id
          id=_once(event, run_name, job.backend, job.job_id, job.run_id))


def promotion_decided(run: str, production: str, promotion) -> None:
    """``promotion``: a ``posttrain.promote.promoter.Promotion``. Stated once per history record."""
    d = promotion.decision
    record = promotion.record
    event = "posttrain.promotion.accepted" if d.accepted else "posttrain.promotion.refused"
    payload = {"run_name": run, "production": production, "candidate": d.candidate, "champion": d.champion,
               "accepted": d.accepted, "reason": d.reason if record is None else record.reason,
               "rule": d.rule, "margin": d.margin, "confidence": d.confidence, "prompts": d.prompts,
               "samples_per_prompt": d.samples_per_prompt, "candidate_mean": d.candidate_mean,
               "champion_mean": d.champion_mean, "lower_bound": d.lower_bound,
               "record": record.seq if record else None, "failures": promotion.failures}
    related = [snapshot_resource(d.candidate, "candidate"), run_resource(run)]
    if d.champion:
        related.append(snapshot_resource(d.champion, "champion"))
    _emit(event, block_resource(production) | {"posttrain.snapshot": d.candidate}, related, payload,
          id=_once(event, production, record.seq, record.at.isoformat()) if record else None)


def rollback_done(run: str, production: str, done) -> None:
    """``done``: a ``posttrain.promote.promoter.Rollback``."""
    record = done.record
    payload = {"run_name": run, "production": production, "identity": record.identity, "previous": record.previous,
               "record": record.seq, "reason": record.reason, "seconds": round(done.served.seconds, 3)}
    related = [snapshot_resource(record.identity, "snapshot"), run_resource(run)]
    if record.previous:
        related.append(snapshot_resource(record.previous, "previous"))
    _emit("posttrain.rollback.done", block_resource(production) | {"posttrain.snapshot": record.identity}, related,
          payload, id=_once("posttrain.rollback.done", production, record.seq, record.at.isoformat()))
