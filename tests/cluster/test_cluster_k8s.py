"""Kubernetes manifests (golden files, official schemas) and the client code against a fake API."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1JobCondition,
    V1JobStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodStatus,
)

from posttrain.cluster import JobFailed, JobSpec, KubernetesConfig, SubmissionError
from posttrain.cluster import k8s_manifests as manifests_module
from posttrain.cluster.k8s import KubernetesBackend, KubernetesHandle
from posttrain.cluster.spec import JobState


def api_exception(status: int, reason: str = "") -> Exception:
    from kubernetes.client.exceptions import ApiException

    return ApiException(status=status, reason=reason)

K8S_VERSION = kubernetes_validate.utils.latest_version()


def full_config(**change: Any) -> KubernetesConfig:
    return KubernetesConfig(
        **{
            "namespace": "ml-team",
            "image": "ghcr.io/example/posttrain:1.0",
            "nodes": 2,
            "gpus_per_node": 8,
            "cpu": "96",
            "memory_request": "960Gi",
            "shm_size": "128Gi",
            "pvc": "shared-vast",
            "pvc_mount": "/data",
            "scratch_size": "500Gi",
            "rdma": True,
            "node_selector": {"gpu.nvidia.com/class": "H100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priority_class": "training-high",
            "service_account": "posttrain-trainer",
            "secret_env": {"HF_TOKEN": "hf-credentials/token", "WANDB_API_KEY": "wandb/api-key"},
            "secrets": ["GITHUB_PAT", "DB_PASS"],
            "env": {"NCCL_DEBUG": "WARN"},
            "setup_commands": ["nvidia-smi -L"],
            "object_storage": {"org_id": "cw1234", "region": "US-EAST-04A"},
            "time_limit": "1-00:00:00",
            "ttl_seconds_after_finished": 3600,
            "backoff_limit": 4,
            **change,
        }
    )


def minimal_config(**change: Any) -> KubernetesConfig:
    return KubernetesConfig(**{"namespace": "default", "image": "posttrain:dev", "pvc": "data", "nodes": 1,
                               "gpus_per_node": 1, "rdma": False, "time_limit": None, **change})  # fmt: skip


def spec(**change: Any) -> JobSpec:
    return JobSpec(
        **{
            "name": "grpo-nightly",
            "run_id": "20250101-000000-abcd",
            "command": ["python", "-m", "posttrain.trainer", "{job_dir}/trainer.yaml"],
            "files": {"trainer.yaml": "model: Qwen/Qwen2.5-0.5B-Instruct\noutput_dir: /data/runs/grpo\n"},
            "output_dir": "/data/runs/grpo",
            **change,
        }
    )


CONFIGS = {
    "full": full_config(),
    "minimal": minimal_config(),
    "accelerate-4nodes": full_config(nodes=4, launcher="accelerate", object_storage=None, secret_env={},
                                     secrets=[]),
    "cpu-only": minimal_config(gpus_per_node=0, scratch_size="10Gi", ttl_seconds_after_finished=None),
    "user-nccl": full_config(env={"NCCL_IB_HCA": "mlx5", "HF_HOME": "/data/cache/hf"}, job_name="grpo-custom"),
    "rdzv-host": full_config(rdzv_host="10.9.8.7", master_port=29611),
}


def test_golden_manifests(golden, no_contact) -> None:
    golden("k8s_2nodes_rdma_storage.yaml", KubernetesBackend(full_config()).render(spec()))
    golden("k8s_1node_minimal.yaml", KubernetesBackend(minimal_config()).render(spec()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_manifest_validates_against_the_official_schema(name: str) -> None:
    config = CONFIGS[name]
    objects = KubernetesBackend(config).manifests(spec())
    kinds = ["Service", "ConfigMap", *(["Secret"] if config.secrets else []), "Job"]
    assert [o["kind"] for o in objects] == kinds
    for obj in objects:
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION.rsplit(".", 1)[0]
    # what submission sends too: the suspended Job and owner references
    suspended = dict(objects[-1], spec=dict(objects[-1]["spec"], suspend=True))
    kubernetes_validate.validate(suspended, K8S_VERSION, strict=True)
    for obj in objects[:-1]:
        owned = dict(obj, metadata=dict(obj["metadata"], ownerReferences=[
            {"apiVersion": "batch/v1", "kind": "Job", "name": "x", "uid": "u"}]))  # fmt: skip
        kubernetes_validate.validate(owned, K8S_VERSION, strict=True)


def test_rendezvous_follows_the_same_rule_as_slurm() -> None:
    """Pod 0's stable name through the headless Service, or rdzv_host; the dry run says which."""
    def env_of(config: KubernetesConfig) -> dict[str, str]:
        job = KubernetesBackend(config).manifests(spec())[-1]
        (container,) = job["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in container["env"]}

    name = "grpo-nightly-20250101-000000-abcd"
    assert env_of(full_config())["MASTER_ADDR"] == f"{name}-0.{name}.ml-team.svc.cluster.local"
    env = env_of(CONFIGS["rdzv-host"])
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.9.8.7", "29611")
    text = KubernetesBackend(CONFIGS["rdzv-host"]).render(spec())
    assert "# rendezvous: MASTER_ADDR is 10.9.8.7 (the cluster's rdzv_host); MASTER_PORT=29611" in text
    assert "# rendezvous:" not in KubernetesBackend(minimal_config()).render(spec())  # one node: none


def test_schema_version_is_current() -> None:
    major, minor = (int(x) for x in K8S_VERSION.split(".")[:2])
    assert (major, minor) >= (1, 33)


def test_dry_run_yaml_is_the_manifests_without_anchors(no_contact) -> None:
    text = KubernetesBackend(full_config()).render(spec())
    assert "&id" not in text and "*id" not in text
    assert list(yaml.safe_load_all(text)) == KubernetesBackend(full_config()).manifests(spec())


def test_job_shape() -> None:
    service, configmap, secret, job = KubernetesBackend(full_config()).manifests(spec())
    name = "grpo-nightly-20250101-000000-abcd"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"posttrain/job": name}
    js = job["spec"]
    assert (js["completionMode"], js["completions"], js["parallelism"]) == ("Indexed", 2, 2)
    assert (js["activeDeadlineSeconds"], js["ttlSecondsAfterFinished"], js["backoffLimit"]) == (86400, 3600, 4)
    pod = js["template"]["spec"]
    assert pod["subdomain"] == name and pod["restartPolicy"] == "Never"
    assert pod["serviceAccountName"] == "posttrain-trainer" and pod["priorityClassName"] == "training-high"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    (container,) = pod["containers"]
    res = container["resources"]
    assert res["requests"] == res["limits"] == {"cpu": "96", "memory": "960Gi", "nvidia.com/gpu": "8", "rdma/ib": "1"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["MASTER_ADDR"] == f"{name}-0.{name}.ml-team.svc.cluster.local"
    assert env["NCCL_IB_HCA"] == "ibp" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["HF_HOME"] == "/data/hf" and env["TRITON_CACHE_DIR"].startswith("/scratch/")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/scratch/")
    assert env["AWS_CONTAINER_CREDENTIALS_FULL_URI"].endswith("/temporary-credentials/oidc/cw1234")
    assert env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] == "/var/run/caios/token"
    assert env["AWS_ENDPOINT_URL_S3"] == "http://cwlota.com" and env["AWS_REGION"] == "US-EAST-04A"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}
    assert "GITHUB_PAT" not in env and container["envFrom"] == [{"secretRef": {"name": name}}]
    assert secret["metadata"]["name"] == name and secret["type"] == "Opaque"
    assert secret["stringData"] == {"DB_PASS": "${DB_PASS}", "GITHUB_PAT": "${GITHUB_PAT}"}  # never a value
    volumes = {v["name"]: v for v in pod["volumes"]}
    token = volumes["caios-token"]["projected"]["sources"][0]["serviceAccountToken"]
    assert token["audience"] == "https://coreweave.com/iam"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "shared-vast"
    assert "torchrun --nnodes=2 --nproc_per_node=8" in configmap["data"]["entrypoint.sh"]
    assert "/posttrain-job/trainer.yaml" in configmap["data"]["entrypoint.sh"]


def test_user_env_replaces_defaults_and_is_never_overridden() -> None:
    job = KubernetesBackend(CONFIGS["user-nccl"]).manifests(spec())[-1]
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names))
    values = {e["name"]: e.get("value") for e in env}
    assert values["NCCL_IB_HCA"] == "mlx5" and values["HF_HOME"] == "/data/cache/hf"
    assert values["NCCL_SOCKET_IFNAME"] == "eth0"


def test_entrypoint_parses_with_bash(tmp_path: Path) -> None:
    configmap = KubernetesBackend(full_config()).manifests(spec())[1]
    path = tmp_path / "entrypoint.sh"
    path.write_text(configmap["data"]["entrypoint.sh"])
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_dry_run_submit_contacts_nothing(capsys, monkeypatch, no_contact) -> None:
    def no_api(self: Any) -> Any:
        raise AssertionError("dry run asked for an API client")

    monkeypatch.setattr(KubernetesBackend, "apis", no_api)
    handle = KubernetesBackend(full_config(dry_run=True)).submit(spec())
    assert handle.state() == JobState.DRY_RUN
    out = capsys.readouterr().out
    assert out.startswith("# posttrain dry run") and "kind: Job" in out


# ---------------------------------------------------------------- client code, fake API


def test_submit_creates_the_job_suspended_then_owned_objects_then_resumes(fake_kube, monkeypatch) -> None:
    monkeypatch.setenv("GITHUB_PAT", "ghp-planted-value")
    monkeypatch.setenv("DB_PASS", "db-planted-value")
    handle = KubernetesBackend(full_config(), apis=(fake_kube.batch, fake_kube.core)).submit(spec())
    assert fake_kube.names() == [
        "create_namespaced_job", "create_namespaced_service", "create_namespaced_config_map",
        "create_namespaced_secret", "patch_namespaced_job",
    ]  # fmt: skip
    (_, (ns, job), _), (_, (_, service), _), (_, (_, configmap), _), (_, (_, secret), _), (_, patch_args, _) = (
        fake_kube.calls
    )
    assert ns == "ml-team" and job["spec"]["suspend"] is True
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"], "uid": "uid-1234"}
    assert service["metadata"]["ownerReferences"] == [owner] == configmap["metadata"]["ownerReferences"]
    # the Secret, owned by the Job (deleted with it), is the only object holding the values
    assert secret["metadata"]["ownerReferences"] == [owner]
    assert secret["stringData"] == {"DB_PASS": "db-planted-value", "GITHUB_PAT": "ghp-planted-value"}
    assert "planted" not in str([job, service, configmap])
    assert patch_args == (job["metadata"]["name"], "ml-team", {"spec": {"suspend": False}})
    assert handle.job_id == f"ml-team/{job['metadata']['name']}"
    fake_kube.job_status = _condition("Complete")
    assert handle.wait(timeout_s=5) == JobState.COMPLETED


def test_failed_step_deletes_the_job_so_nothing_is_orphaned(fake_kube, monkeypatch) -> None:
    monkeypatch.setenv("GITHUB_PAT", "ghp-planted-value")
    monkeypatch.setenv("DB_PASS", "db-planted-value")
    fake_kube.fail["create_namespaced_config_map"] = api_exception(403, "Forbidden")
    with pytest.raises(SubmissionError, match=r"ConfigMap of job .* failed \(403 Forbidden\); the Job was deleted"):
        KubernetesBackend(full_config(), apis=(fake_kube.batch, fake_kube.core)).submit(spec())
    name, args, kwargs = fake_kube.calls[-1]
    assert name == "delete_namespaced_job" and kwargs == {"propagation_policy": "Background"}


def test_existing_job_is_reported(fake_kube, monkeypatch) -> None:
    monkeypatch.setenv("GITHUB_PAT", "ghp-planted-value")
    monkeypatch.setenv("DB_PASS", "db-planted-value")
    fake_kube.fail["create_namespaced_job"] = api_exception(409, "Conflict")
    with pytest.raises(SubmissionError, match="already exists"):
        KubernetesBackend(full_config(), apis=(fake_kube.batch, fake_kube.core)).submit(spec())
    assert fake_kube.names() == ["create_namespaced_job"]


def _pod(rank: int, phase: str = "Running", waiting: str | None = None, terminated: tuple[str, int] | None = None):
    state = V1ContainerState(
        waiting=V1ContainerStateWaiting(reason=waiting, message="back-off pulling image") if waiting else None,
        terminated=V1ContainerStateTerminated(reason=terminated[0], exit_code=terminated[1]) if terminated else None,
    )
    status = V1ContainerStatus(name="main", image="i", image_id="", ready=phase == "Running", restart_count=0,
                               state=state)  # fmt: skip
    meta = V1ObjectMeta(name=f"job-{rank}-abcde", labels={"batch.kubernetes.io/job-completion-index": str(rank)})
    return V1Pod(metadata=meta, status=V1PodStatus(phase=phase, container_statuses=[status]))


def _handle(fake_kube, **kw: Any) -> KubernetesHandle:
    args = {"nodes": 2, "poll_s": 0.01, "stuck_after_s": 0.05, **kw}
    return KubernetesHandle(fake_kube.batch, fake_kube.core, "job", "ml", **args)


def _condition(kind: str, reason: str = "") -> V1JobStatus:
    return V1JobStatus(conditions=[V1JobCondition(type=kind, status="True", reason=reason, message="m")])


def test_state_follows_the_job_conditions(fake_kube) -> None:
    handle = _handle(fake_kube)
    fake_kube.pods = [_pod(0, "Pending"), _pod(1, "Pending")]
    assert handle.state() == JobState.PENDING
    fake_kube.pods = [_pod(0), _pod(1)]
    assert handle.state() == JobState.RUNNING
    fake_kube.job_status = _condition("Complete")
    assert handle.state() == JobState.COMPLETED and handle.done()
    fake_kube.job_status = _condition("Failed", "DeadlineExceeded")
    assert handle.state() == JobState.TIMEOUT
    fake_kube.job_status = _condition("Failed", "BackoffLimitExceeded")
    assert handle.state() == JobState.FAILED


def test_failure_reason_names_the_failing_pod(fake_kube) -> None:
    fake_kube.job_status = _condition("Failed", "BackoffLimitExceeded")
    fake_kube.pods = [_pod(0, "Failed", terminated=("OOMKilled", 137)), _pod(1, "Failed", terminated=("Error", 1))]
    reason = _handle(fake_kube).failure_reason()
    assert "BackoffLimitExceeded" in reason
    assert "rank 0 (pod job-0-abcde): OOMKilled, exit code 137" in reason
    assert "rank 1 (pod job-1-abcde): Error, exit code 1" in reason


def test_wait_gives_up_on_a_stuck_image_pull(fake_kube) -> None:
    fake_kube.pods = [_pod(0, "Pending", waiting="ImagePullBackOff"), _pod(1, "Pending")]
    with pytest.raises(JobFailed, match="ImagePullBackOff: back-off pulling image"):
        _handle(fake_kube).wait(timeout_s=5)


def test_tail_log_covers_every_rank(fake_kube) -> None:
    fake_kube.pods = [_pod(1), _pod(0)]
    fake_kube.logs = {"job-0-abcde": "step 1\n", "job-1-abcde": "step 1 (rank 1)\n"}
    text = _handle(fake_kube).tail_log(5)
    assert text.index("==> rank 0") < text.index("==> rank 1")
    assert "step 1 (rank 1)" in text
    assert fake_kube.calls[-1][2] == {"container": "main", "tail_lines": 5}


def test_follow_logs_streams_every_rank_with_a_prefix(fake_kube) -> None:
    fake_kube.pods = [_pod(0), _pod(1)]
    fake_kube.logs = {"job-0-abcde": "hello\nworld\n", "job-1-abcde": "from one\n"}
    lines: list[str] = []
    follower = _handle(fake_kube).follow_logs(lines.append)
    deadline = time.monotonic() + 5
    while len(lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    follower.stop()
    assert sorted(lines) == ["[rank 0] hello\n", "[rank 0] world\n", "[rank 1] from one\n"]


def test_cancel_deletes_the_job_in_the_foreground(fake_kube) -> None:
    handle = _handle(fake_kube)
    handle.cancel()
    assert fake_kube.calls[-1] == ("delete_namespaced_job", ("job", "ml"), {"propagation_policy": "Foreground"})
    fake_kube.job_status = api_exception(404, "Not Found")
    assert handle.state() == JobState.CANCELLED


def test_leaving_the_block_by_an_exception_cancels(fake_kube) -> None:
    fake_kube.pods = [_pod(0), _pod(1)]
    with pytest.raises(KeyboardInterrupt):
        with _handle(fake_kube):
            raise KeyboardInterrupt
    assert fake_kube.names()[-1] == "delete_namespaced_job"


def test_manifest_module_needs_no_client() -> None:
    # rendering is pure: the kubernetes package is not imported by k8s_manifests
    assert "kubernetes" not in manifests_module.__dict__


def test_strict_schema_catches_a_misspelled_field() -> None:
    job = KubernetesBackend(minimal_config()).manifests(spec())[2]
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_kubeconfig_and_context_are_used_without_contacting_the_server(tmp_path: Path, no_contact) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "a", "cluster": {"server": "https://a.example:6443"}},
                             {"name": "b", "cluster": {"server": "https://b.example:6443"}}],
                "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
                "contexts": [{"name": "ctx-a", "context": {"cluster": "a", "user": "u"}},
                             {"name": "ctx-b", "context": {"cluster": "b", "user": "u"}}],
                "current-context": "ctx-a",
            }
        )
    )  # fmt: skip
    batch, core = KubernetesBackend(minimal_config(kubeconfig=str(kubeconfig), context="ctx-b")).apis()
    assert batch.api_client.configuration.host == "https://b.example:6443"
    assert core.api_client is batch.api_client
