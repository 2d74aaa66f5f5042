"""Every bad setting is refused with an error that names the field to fix."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from posttrain.cluster import (
    ConfigError,
    JobSpec,
    KubernetesConfig,
    LocalConfig,
    SlurmConfig,
    describe_validation_error,
    open_backend,
    parse_cluster_config,
)
from posttrain.cluster.checks import time_limit_seconds

SLURM_OK: dict[str, Any] = {"shared_dir": "/mnt/shared", "image": "ghcr.io/org/img:tag"}
K8S_OK: dict[str, Any] = {"namespace": "ml", "image": "ghcr.io/org/img:tag", "pvc": "data"}
STORAGE = {"org_id": "abc", "region": "US-EAST-04A"}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


BAD_SLURM = [
    ({"shared_dir": "shared"}, "shared_dir"),
    ({"shared_dir": "/mnt/../etc"}, "shared_dir"),
    ({"env_file": "secrets.env"}, "env_file"),
    ({"env_file": "/home/me/secrets.env"}, "env_file"),
    ({"mounts": ["data"]}, "mounts"),
    ({"mounts": ["/mnt/a,b"]}, "mounts"),
    ({"job_root": "/tmp/jobs"}, "job_root"),
    ({"image": ""}, "image"),
    ({"image": "docker://ghcr.io/org/img:tag"}, "image"),
    ({"image": "images/posttrain.sqsh"}, "image"),
    ({"image": "/opt/images/posttrain.sqsh"}, "image"),
    ({"image": "my image"}, "image"),
    ({"image": "oras://registry/img"}, "image"),
    ({"nodes": 0}, "nodes"),
    ({"nodes": -2}, "nodes"),
    ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"cpus_per_task": 0}, "cpus_per_task"),
    ({"env": {"MASTER_ADDR": "10.0.0.1"}}, "env"),
    ({"env": {"MASTER_PORT": "1234"}}, "env"),
    ({"env": {"SLURM_JOB_ID": "1"}}, "env"),
    ({"env": {"POSTTRAIN_JOB_DIR": "/x"}}, "env"),
    ({"env": {"WORLD_SIZE": "8"}}, "env"),
    ({"env": {"1BAD": "x"}}, "env"),
    ({"env": {"HF_TOKEN": "hf_abc"}}, "env"),
    ({"env": {"WANDB_API_KEY": "abc"}}, "env"),
    ({"launcher_args": ["--nnodes=2"]}, "launcher_args"),
    ({"launcher_args": ["--nproc_per_node", "8"]}, "launcher_args"),
    ({"launcher_args": ["--nproc-per-node=8"]}, "launcher_args"),
    ({"launcher_args": ["--node_rank=0"]}, "launcher_args"),
    ({"launcher_args": ["--master_addr=10.0.0.1"]}, "launcher_args"),
    ({"launcher_args": ["--rdzv_endpoint=host:29400"]}, "launcher_args"),
    ({"launcher_args": ["--num_processes=16"]}, "launcher_args"),
    ({"launcher_args": ["--num_machines", "2"]}, "launcher_args"),
    ({"launcher_args": ["--main_process_ip=x"]}, "launcher_args"),
    ({"launcher": "deepspeed"}, "launcher"),
    ({"launcher": "python", "nodes": 2}, "launcher"),
    ({"time_limit": "1 day"}, "time_limit"),
    ({"time_limit": None}, "time_limit"),
    ({"time_limit": "0"}, "time_limit"),
    ({"memory": "lots"}, "memory"),
    ({"partition": "h100 gpu"}, "partition"),
    ({"account": "a;b"}, "account"),
    ({"ssh_host": "-oProxyCommand=evil"}, "ssh_host"),
    ({"master_port": 80}, "master_port"),
    ({"max_requeues": -1}, "max_requeues"),
    ({"gpus": 8}, "gpus"),  # unknown field (it is gpus_per_node)
]


@pytest.mark.parametrize(("change", "field"), BAD_SLURM, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_SLURM)])
def test_bad_slurm_setting_names_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        SlurmConfig(**{**SLURM_OK, **change})
    assert field in describe_validation_error(info.value)


def test_slurm_image_may_be_left_out() -> None:
    # a site without containers writes no image: line (it was required, even as null)
    assert SlurmConfig(**_without(SLURM_OK, "image")).image is None
    assert SlurmConfig(**{**SLURM_OK, "image": None}).image is None


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("ghcr.io/org/img:tag", "docker://ghcr.io#org/img:tag"),
        ("localhost:5000/img", "docker://localhost:5000#img"),
        ("nvcr.io/nvidia/pytorch:25.01-py3", "docker://nvcr.io#nvidia/pytorch:25.01-py3"),
        ("docker://ghcr.io#org/img:tag", "docker://ghcr.io#org/img:tag"),
        ("pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime", "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime"),
        ("ubuntu:22.04", "ubuntu:22.04"),
        ("/mnt/shared/images/posttrain.sqsh", "/mnt/shared/images/posttrain.sqsh"),
    ],
)
def test_pyxis_image_forms(image: str, expected: str) -> None:
    assert SlurmConfig(**{**SLURM_OK, "image": image}).image == expected


BAD_K8S = [
    ({"job_name": "Bad_Name"}, "job_name"),
    ({"job_name": "a" * 53}, "job_name"),
    ({"namespace": "ML"}, "namespace"),
    ({"nodes": 0}, "nodes"),
    ({"gpus_per_node": -8}, "gpus_per_node"),
    ({"env": {"MASTER_ADDR": "x"}}, "env"),
    ({"env": {"JOB_COMPLETION_INDEX": "0"}}, "env"),
    ({"env": {"HF_TOKEN": "hf_abc"}}, "env"),
    ({"env": {"AWS_REGION": "x"}, "object_storage": STORAGE}, "env"),
    ({"secret_env": {"AWS_ENDPOINT_URL_S3": "s/k"}, "object_storage": STORAGE}, "secret_env"),
    ({"secret_env": {"HF_TOKEN": "no-key"}}, "secret_env"),
    ({"secret_env": {"MASTER_PORT": "s/k"}}, "secret_env"),
    ({"env": {"DB_URL": "x"}, "secret_env": {"DB_URL": "s/k"}}, "env"),
    ({"env_file": "/mnt/shared/x.env"}, "env_file"),
    ({"cpu": "lots"}, "cpu"),
    ({"memory_request": "256GB"}, "memory_request"),
    ({"shm_size": "-1Gi"}, "shm_size"),
    ({"scratch_size": "big"}, "scratch_size"),
    ({"pvc": "Data_Vol"}, "pvc"),
    ({"pvc_mount": "data"}, "pvc_mount"),
    ({"tolerations": [{"key": "gpu", "operator": "Maybe"}]}, "tolerations"),
    ({"node_selector": {"bad key!": "x"}}, "node_selector"),
    ({"launcher_args": ["--nnodes", "2"]}, "launcher_args"),
    ({"launcher": "python", "nodes": 2}, "launcher"),
    ({"time_limit": "forever"}, "time_limit"),
    ({"backoff_limit": -1}, "backoff_limit"),
    ({"object_storage": {"org_id": "abc"}}, "object_storage"),
    ({"ssh_host": "login"}, "ssh_host"),  # a Slurm setting
]


@pytest.mark.parametrize(("change", "field"), BAD_K8S, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_K8S)])
def test_bad_kubernetes_setting_names_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        KubernetesConfig(**{**K8S_OK, **change})
    assert field in describe_validation_error(info.value)


@pytest.mark.parametrize("missing", ["namespace", "image", "pvc"])
def test_kubernetes_required_settings(missing: str) -> None:
    with pytest.raises(ValidationError) as info:
        KubernetesConfig(**_without(K8S_OK, missing))
    assert missing in describe_validation_error(info.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"env": {"MASTER_PORT": "1"}}, "env"), ({"gpus": -1}, "gpus"), ({"launcher": "mpirun"}, "launcher")],
)
def test_bad_local_setting_names_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LocalConfig(**change)
    assert field in describe_validation_error(info.value)


BAD_SPECS = [
    ({"name": "Grpo"}, "name"),
    ({"name": "g" * 32}, "name"),
    ({"run_id": "Run 1"}, "run_id"),
    ({"command": None}, "command"),
    ({"command": []}, "command"),
    ({"function": print}, "command"),  # both command and function
    ({"files": {"../trainer.yaml": "x"}}, "files"),
    ({"env": {"BAD-NAME": "x"}}, "env"),
]


@pytest.mark.parametrize(("change", "field"), BAD_SPECS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_SPECS)])
def test_bad_job_spec_names_field(change: dict[str, Any], field: str) -> None:
    data = {"name": "grpo", "command": ["python", "-m", "posttrain.trainer"], **change}
    with pytest.raises(ValidationError) as info:
        JobSpec(**data)
    assert field in describe_validation_error(info.value, "job")


def _spec(**change: Any) -> JobSpec:
    return JobSpec(**{"name": "grpo", "run_id": "r1", "command": ["python", "-m", "posttrain.trainer"], **change})


BAD_FOR_BACKEND = [
    (SlurmConfig(**SLURM_OK), {"output_dir": "/tmp/out"}, "job.output_dir"),
    (SlurmConfig(**SLURM_OK), {"output_dir": "out"}, "job.output_dir"),
    (SlurmConfig(**SLURM_OK), {"workdir": "/home/me"}, "job.workdir"),
    (SlurmConfig(**SLURM_OK), {"env": {"SLURM_NNODES": "2"}}, "job.env"),
    (SlurmConfig(**SLURM_OK), {"env": {"HF_TOKEN": "x"}}, "job.env"),
    (SlurmConfig(**SLURM_OK, env={"NCCL_DEBUG": "WARN"}), {"env": {"NCCL_DEBUG": "INFO"}}, "job.env"),
    (SlurmConfig(**SLURM_OK), {"command": ["bash", "train.sh"]}, "job.command"),
    (SlurmConfig(**SLURM_OK), {"command": ["python", "-u", "train.py"]}, "job.command"),
    (KubernetesConfig(**K8S_OK), {"output_dir": "/mnt/out"}, "job.output_dir"),
    (KubernetesConfig(**K8S_OK), {"command": None, "function": print}, "job.function"),
    (KubernetesConfig(**K8S_OK), {"env": {"MASTER_ADDR": "x"}}, "job.env"),
    (KubernetesConfig(**K8S_OK, secret_env={"DB": "s/k"}), {"env": {"DB": "x"}}, "job.env"),
    (KubernetesConfig(**K8S_OK, launcher="accelerate"), {"command": ["torchrun", "x.py"]}, "job.command"),
    (LocalConfig(launcher="torchrun"), {"command": ["./train"]}, "job.command"),
    (LocalConfig(), {"env": {"MASTER_PORT": "1"}}, "job.env"),
]


@pytest.mark.parametrize(
    ("config", "change", "field"),
    BAD_FOR_BACKEND,
    ids=[f"{type(c).__name__}-{f}-{i}" for i, (c, _, f) in enumerate(BAD_FOR_BACKEND)],
)
def test_spec_checked_against_backend(config: Any, change: dict[str, Any], field: str, no_contact: None) -> None:
    with pytest.raises(ConfigError) as info:
        open_backend(config).render(_spec(**change))
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_parse_cluster_config_picks_the_type() -> None:
    assert isinstance(parse_cluster_config("slurm", SLURM_OK), SlurmConfig)
    assert isinstance(parse_cluster_config("k8s", K8S_OK), KubernetesConfig)
    assert isinstance(parse_cluster_config("local", {}), LocalConfig)
    with pytest.raises(ValueError, match="backend"):
        parse_cluster_config("nomad", {})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30", 1800), ("30:15", 1815), ("24:00:00", 86400), ("2-12", 216000), ("1-00:30", 88200), ("1-01:01:01", 90061)],
)
def test_time_limit_formats(text: str, seconds: int) -> None:
    assert time_limit_seconds(text) == seconds


def test_every_field_is_described() -> None:
    from posttrain.cluster.config import ObjectStorage, Toleration

    for cls in (SlurmConfig, KubernetesConfig, LocalConfig, ObjectStorage, Toleration, JobSpec):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"
        assert cls.model_config.get("extra") == "forbid"


@pytest.mark.parametrize("value", [1e-300, 0.01, 0, float("nan"), float("inf")])
@pytest.mark.parametrize(("config", "given"), [(SlurmConfig, SLURM_OK), (KubernetesConfig, K8S_OK), (LocalConfig, {})],
                         ids=["slurm", "kubernetes", "local"])
def test_a_busy_poll_interval_is_refused(config, given, value) -> None:
    """1e-300 passed ``> 0``, and following the job then checked its state without pause."""
    with pytest.raises(ValidationError) as info:
        config(**given, poll_interval_s=value)
    assert describe_validation_error(info.value).startswith("poll_interval_s: ")
    assert config(**given, poll_interval_s=0.05).poll_interval_s == 0.05
