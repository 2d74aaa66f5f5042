"""Where training runs: Slurm (through submitit), Kubernetes (Indexed Jobs) or this machine.

    from posttrain.cluster import JobSpec, SlurmConfig, open_backend

    backend = open_backend(SlurmConfig(shared_dir="/mnt/shared", image="...", nodes=2))
    spec = JobSpec(name="grpo", command=["python", "-m", "posttrain.trainer", "{job_dir}/trainer.yaml"],
                   files={"trainer.yaml": text})
    print(backend.render(spec))            # dry run: contacts nothing
    with backend.submit(spec) as job:      # cancelled if the block is left by an exception
        print(job.job_id, job.log_path)
        job.wait()

Importing this package loads pydantic only; submitit and kubernetes load with their backend.
"""

from posttrain.cluster.backend import open_backend
from posttrain.cluster.config import (
    ClusterConfig,
    KubernetesConfig,
    LocalConfig,
    ObjectStorage,
    SlurmConfig,
    Toleration,
    parse_cluster_config,
)
from posttrain.cluster.errors import (
    ClusterError,
    ConfigError,
    JobFailed,
    SubmissionError,
    describe_validation_error,
)
from posttrain.cluster.spec import Backend, JobHandle, JobSpec, JobState

__all__ = [
    "Backend",
    "ClusterConfig",
    "ClusterError",
    "ConfigError",
    "JobFailed",
    "JobHandle",
    "JobSpec",
    "JobState",
    "KubernetesConfig",
    "LocalConfig",
    "ObjectStorage",
    "SlurmConfig",
    "SubmissionError",
    "Toleration",
    "describe_validation_error",
    "open_backend",
    "parse_cluster_config",
]
