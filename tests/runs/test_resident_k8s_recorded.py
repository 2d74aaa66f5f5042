"""A resident trainer (``mode: resident``) on Kubernetes against a recorded API (``tests/runs/recorded/k8s``,
the real ``kubernetes`` client): six asynchronous rounds are one Job, submitted once (a retried
pipeline finds it by its marker), handed round by round and followed to its completion; a cancel
mid-run deletes the Job with its pods. The Job's pods are played by the test: they read each round's
marker and write its checkpoint in the PVC. The settings are the pipeline's
(``TrainingSettings.for_pipeline``): this machine mounts the PVC at ``pvc_mount`` as the pods do, so
it hands rounds and watches checkpoints at the job's own paths."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml

import posttrain.runs.once as once
from posttrain.runs.follow import TrainingFailed
from posttrain.runs.job import TrainingSettings, results_path
from posttrain.runs.resident import ResidentRun
from posttrain.trainer.config import TrainerConfig
from posttrain.trainer.rounds import read_ready
from tests.runs.test_once_k8s_recorded import JOB, NAME, NAMESPACE, api, cluster, lines, no_live_runs  # noqa: F401

ROUNDS, K = 6, 1
SUBMIT = [f"POST /apis/batch/v1/namespaces/{NAMESPACE}/jobs", f"POST /api/v1/namespaces/{NAMESPACE}/services",
          f"POST /api/v1/namespaces/{NAMESPACE}/configmaps", f"PATCH {JOB}"]


def resident_settings(tmp_path: Path, url: str) -> TrainingSettings:
    pvc = tmp_path / "pvc"  # the PVC, mounted here where the pods mount it
    run = pvc / "runs" / "grpo-7f3a9c1e"
    trainer = TrainerConfig(mode="resident", model_name_or_path=str(pvc / "models" / "base"),
                            output_dir=run / "policy", rounds_dir=run / "rounds", rounds=ROUNDS, max_staleness=K,
                            round_timeout_s=600)
    k8s = cluster(tmp_path, url).model_copy(update={"job_name": NAME, "pvc_mount": str(pvc)})
    settings = TrainingSettings.for_pipeline("grpo-7f3a9c1e-resident", k8s, trainer)
    assert settings.watch_dir == str(run / "policy")  # what the flow watches: the job's output_dir itself
    return settings.model_copy(update={"run_id": "20260301-020000-ab12"})


def pods(recorded, settings: TrainingSettings, local_rounds: Path, seen: list, stop: threading.Event) -> None:
    """The Job's pods: each round, once handed, trained into checkpoint-<r + 1>; then the result, and
    the Job completes."""
    from tests.support.training import _make_checkpoint

    out = Path(settings.watch_dir)
    for r in range(ROUNDS):
        while (ready := read_ready(local_rounds, r)) is None:
            if stop.wait(0.01):
                return
        seen.append((r, ready.policy_versions))
        time.sleep(0.05)  # the update
        _make_checkpoint(out, r + 1)
    path = Path(results_path(out, settings.name, settings.run_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{{"mode": "resident", "global_step": {ROUNDS}, "completed": true, "rounds_done": {ROUNDS}}}\n')
    recorded.answer("get-job-complete")


def test_six_asynchronous_rounds_are_one_kubernetes_job(api, tmp_path):  # noqa: F811
    recorded, url = api
    recorded.answer("post-job-created", "post-service-created", "post-configmap-created", "patch-job-resumed",
                    "get-job-running")
    settings = resident_settings(tmp_path, url)
    marker = tmp_path / "training-job.json"
    record, new = once.submit_once(settings, marker)
    assert new and lines(recorded) == SUBMIT
    created, _, configmap, resume = (r.body for r in recorded.received)
    assert created["spec"]["suspend"] is True and resume == {"spec": {"suspend": False}}
    trainer = yaml.safe_load(configmap["data"]["trainer.yaml"])  # what the pods run
    assert trainer["mode"] == "resident" and trainer["rounds"] == ROUNDS and trainer["max_staleness"] == K
    assert once.submit_once(settings, marker) == (record, False)  # a retried pipeline finds it
    assert lines(recorded) == SUBMIT

    rounds = Path(settings.trainer.rounds_dir)
    job = ResidentRun(record, settings.cluster, settings.trainer, cursor_path=tmp_path / "cursor.json",
                      poll_interval=0.02)
    seen: list = []
    stop = threading.Event()
    worker = threading.Thread(target=pods, args=(recorded, settings, rounds, seen, stop))
    worker.start()
    try:
        for r in range(ROUNDS):
            policy = job.policy_for(r, K)
            (rounds / f"{r:04d}").mkdir(parents=True)
            (rounds / f"{r:04d}" / "rollouts.jsonl").write_text(f'{{"round": {r}}}\n')
            job.hand(r, job.recorded_version(policy))
        last, result = job.finish(ROUNDS)
    finally:
        stop.set()
        worker.join(10)
    assert result.completed and result.rounds_done == ROUNDS
    assert last.version == ROUNDS and last.path == str(settings.trainer.output_dir / f"checkpoint-{ROUNDS}")
    assert [r for r, _ in seen] == list(range(ROUNDS))
    assert all(r - K <= v <= r for r, (v,) in seen), seen  # handed within the bound
    assert any(v < r for r, (v,) in seen), seen  # and ahead of training
    # one Job: after the submission, only status reads
    assert lines(recorded)[:4] == SUBMIT and set(lines(recorded)[4:]) == {f"GET {JOB}/status"}


def test_cancel_mid_run_deletes_the_job_with_its_pods(api, tmp_path):  # noqa: F811
    recorded, url = api
    recorded.answer("post-job-created", "post-service-created", "post-configmap-created", "patch-job-resumed",
                    "get-job-running")
    settings = resident_settings(tmp_path, url)
    record, _ = once.submit_once(settings, tmp_path / "training-job.json")
    job = ResidentRun(record, settings.cluster, settings.trainer, cursor_path=tmp_path / "cursor.json",
                      poll_interval=0.02)
    recorded.answer("delete-job-foreground", "get-job-not-found", "list-pods-gone")
    assert job.cancel() == f"k8s job {NAMESPACE}/{NAME} cancelled (Job deleted with its pods; was RUNNING)"
    assert lines(recorded)[4:] == [f"GET {JOB}/status", f"DELETE {JOB}"]
    with pytest.raises(TrainingFailed, match=r"ended CANCELLED: the Job was deleted \(cancelled\)"):
        job.policy_for(1, 0)  # the watch sees the Job gone: the run fails with the reason
