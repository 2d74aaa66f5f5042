"""What the run's events carry: no secret in an error message or a job's failure reason."""

from __future__ import annotations

import pytest

from posttrain import redact
from posttrain.pipeline.tasks import events
from posttrain.runs.once import JobRecord


@pytest.fixture
def emitted(monkeypatch):
    found: list[dict] = []
    monkeypatch.setattr(events, "emit_event", lambda event, **kw: found.append({"event": event, **kw}))
    return found


def test_a_failed_hot_load_event_carries_the_error_without_secrets(emitted, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-key-0123456789")
    redact.remember("remembered-token-abcdef")
    error = RuntimeError("GET http://alice:pa55word@10.0.0.5:8000/v1/x failed; key env-secret-key-0123456789, "
                         "token remembered-token-abcdef, header Bearer block-token-987654")
    events.hotload_failed("nightly", "posttrain-inference-deployment/default", "run-step-3", error,
                          will_retry=True, secrets=("block-token-987654",))
    (event,) = emitted
    assert event["event"] == "posttrain.hotload.failed"
    message = event["payload"]["error"]
    assert message == ("GET http://***@10.0.0.5:8000/v1/x failed; key ***, token ***, header Bearer ***")
    assert event["resource"]["posttrain.will-retry"] == "true"


def test_a_job_event_reason_carries_no_secret(emitted, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEY123456")
    job = JobRecord(job_id="41", run_id="r1", name="nightly-abc", backend="slurm", log_path=None,
                    output_dir="/shared/runs/nightly/out")
    events.job_event("failed", job, reason="exit 1: s3://AKIAEXAMPLEKEY123456@bucket unreachable")
    (event,) = emitted
    assert event["payload"]["reason"] == "exit 1: s3://***@bucket unreachable"
    assert event["payload"]["run_name"] == "nightly"
