"""runs.once on Kubernetes against a recorded API: the real ``kubernetes`` client, pointed by the
cluster settings' ``kubeconfig`` at a local server replaying kube-apiserver responses
(``tests/runs/recorded/k8s``), cancels a Job of an earlier process by deleting it with its pods,
takes an already-deleted Job in its stride, tells a running Job from one that ended, and
deletes a Job whose submission failed half-way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import posttrain.runs.once as once
from posttrain.cluster import KubernetesConfig
from tests.runs.kube_replay import TOKEN, RecordedKubeApi, kubeconfig
from tests.runs.test_once import write_result

NAMESPACE = "ml-team"
NAME = "nightly-7f3a9c1e-20260301-020000-ab12"  # the Job the recordings are of
JOB = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{NAME}"


@pytest.fixture(autouse=True)
def no_live_runs(monkeypatch):
    monkeypatch.setattr(once, "_RUNS", {})  # every job here was submitted by "an earlier process"


@pytest.fixture
def api() -> Iterator[tuple[RecordedKubeApi, str]]:
    recorded = RecordedKubeApi()
    server, thread = recorded.serve()
    try:
        yield recorded, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def cluster(tmp_path: Path, url: str) -> KubernetesConfig:
    """The cluster block's settings, as a flow hook loads them: only ``kubeconfig`` points here."""
    return KubernetesConfig(namespace=NAMESPACE, image="registry.example/posttrain:1", pvc="shared", nodes=2,
                            rdma=False, kubeconfig=str(kubeconfig(tmp_path / "kubeconfig", url)))


def record(tmp_path: Path) -> once.JobRecord:
    """The submit marker's record of the Job, as ``submit_once`` writes it on Kubernetes."""
    return once.JobRecord(
        job_id=f"{NAMESPACE}/{NAME}", run_id="20260301-020000-ab12", name="nightly-7f3a9c1e", backend="k8s",
        log_path=f"kubectl -n {NAMESPACE} logs -f --prefix --max-log-requests=5 -l posttrain/job={NAME}",
        output_dir="/data/runs/nightly-7f3a9c1e/output", watch_dir=str(tmp_path / "out"))


def lines(recorded: RecordedKubeApi) -> list[str]:
    assert not recorded.unexpected, [r.line for r in recorded.unexpected]
    assert all(r.authorization == f"Bearer {TOKEN}" for r in recorded.received)  # the kubeconfig's user
    return [r.line for r in recorded.received]


def test_cancel_deletes_a_running_job_with_its_pods(api, tmp_path):
    recorded, url = api
    recorded.answer("get-job-running", "delete-job-foreground")
    said = once.cancel_job(record(tmp_path), cluster(tmp_path, url))
    assert said == f"k8s job {NAMESPACE}/{NAME} cancelled (Job deleted with its pods; was RUNNING)"
    assert lines(recorded) == [f"GET {JOB}/status", f"DELETE {JOB}"]
    delete = recorded.received[-1]
    # Foreground: the Job stays (deletionTimestamp, foregroundDeletion finalizer) until its pods are gone.
    assert delete.query == {"propagationPolicy": ["Foreground"]}
    assert delete.body in (None, {}) or delete.body.get("propagationPolicy") == "Foreground"


def test_cancel_of_a_job_deleted_meanwhile_is_fine(api, tmp_path):
    """The Job was running when read, and gone (404 NotFound) by the time it was deleted."""
    recorded, url = api
    recorded.answer("get-job-running", "delete-job-not-found")
    said = once.cancel_job(record(tmp_path), cluster(tmp_path, url))
    assert "cancelled" in said
    assert lines(recorded) == [f"GET {JOB}/status", f"DELETE {JOB}"]


def test_cancel_of_a_job_already_gone_deletes_nothing(api, tmp_path):
    recorded, url = api
    recorded.answer("get-job-not-found")
    said = once.cancel_job(record(tmp_path), cluster(tmp_path, url))
    assert said == f"k8s job {NAMESPACE}/{NAME} was already gone (deleted, or removed after it ended)"
    assert lines(recorded) == [f"GET {JOB}/status"]


@pytest.mark.parametrize("recording,state", [("get-job-complete", "COMPLETED"), ("get-job-failed", "FAILED")])
def test_cancel_of_a_finished_job_deletes_nothing(api, tmp_path, recording, state):
    recorded, url = api
    recorded.answer(recording)
    said = once.cancel_job(record(tmp_path), cluster(tmp_path, url))
    assert said == f"k8s job {NAMESPACE}/{NAME} had already ended ({state})"
    assert lines(recorded) == [f"GET {JOB}/status"]


def test_a_running_job_has_not_ended(api, tmp_path):
    recorded, url = api
    recorded.answer("get-job-running")
    ended = once.ended_check(record(tmp_path), cluster(tmp_path, url))
    assert not ended() and not ended()  # asked again on every poll
    assert lines(recorded) == [f"GET {JOB}/status"] * 2


@pytest.mark.parametrize("recording", ["get-job-complete", "get-job-failed", "get-job-not-found"])
def test_a_finished_or_deleted_job_has_ended(api, tmp_path, recording):
    recorded, url = api
    recorded.answer(recording)
    assert once.job_ended(record(tmp_path), cluster(tmp_path, url))
    assert lines(recorded) == [f"GET {JOB}/status"]


def test_a_running_job_ends_once_cancelled(api, tmp_path):
    """What a retried flow run sees after the cancel hook: running, deleted, then gone."""
    recorded, url = api
    recorded.answer("get-job-running", "get-job-running", "delete-job-foreground", "get-job-not-found")
    job, settings = record(tmp_path), cluster(tmp_path, url)
    ended = once.ended_check(job, settings)
    assert not ended()
    assert "cancelled" in once.cancel_job(job, settings)
    assert ended()
    assert lines(recorded) == [f"GET {JOB}/status", f"GET {JOB}/status", f"DELETE {JOB}", f"GET {JOB}/status"]


def test_a_completed_result_ends_the_job_without_asking_the_api(api, tmp_path):
    recorded, url = api
    job = record(tmp_path)
    write_result(job, step=100)
    assert once.job_ended(job, cluster(tmp_path, url))
    assert recorded.received == []


def test_a_submission_that_fails_half_way_deletes_its_job_and_records_nothing(api, tmp_path):
    """The Job is created suspended, then the Service is refused (RBAC 403): the Job is deleted in
    the background (its owned objects with it) and no marker is written, so a retry submits anew."""
    from posttrain.cluster import SubmissionError
    from posttrain.runs.job import TrainingSettings
    from posttrain.trainer.config import TrainerConfig

    recorded, url = api
    recorded.answer("post-job-created", "post-service-forbidden", "delete-job-background")
    trainer = TrainerConfig(mode="grpo", model_name_or_path="/data/models/base", output_dir="/data/runs/out",
                            dataset_manifest="/data/datasets/m.json",
                            reward_funcs=["posttrain.rewards:format_reward"], max_steps=1)
    settings = TrainingSettings(name="nightly-7f3a9c1e", run_id="20260301-020000-ab12", trainer=trainer,
                                cluster=cluster(tmp_path, url).model_copy(update={"job_name": NAME}))
    marker = tmp_path / "run" / "training-job.json"
    with pytest.raises(SubmissionError, match="Service of job .* failed .*403.*the Job was deleted"):
        once.submit_once(settings, marker)
    assert not marker.exists()
    assert lines(recorded) == [f"POST /apis/batch/v1/namespaces/{NAMESPACE}/jobs",
                               f"POST /api/v1/namespaces/{NAMESPACE}/services", f"DELETE {JOB}"]
    create, _, delete = recorded.received
    assert create.body["metadata"]["name"] == NAME and create.body["spec"]["suspend"] is True
    assert delete.query == {"propagationPolicy": ["Background"]}
