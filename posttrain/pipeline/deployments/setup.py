"""Prepare a Prefect server for posttrain: block types and the work pools prefect.yaml names."""

from __future__ import annotations

import subprocess
import sys

PROCESS_POOL = "posttrain-process"
KUBERNETES_POOL = "posttrain-kubernetes"


def register_blocks() -> list[str]:
    """``prefect block register -m posttrain.pipeline.blocks``, in process."""
    from posttrain.pipeline.blocks import (
        InferenceDeployment,
        KubernetesCluster,
        LocalCluster,
        ObjectStore,
        SlurmCluster,
    )

    done = []
    for cls in (SlurmCluster, KubernetesCluster, LocalCluster, ObjectStore, InferenceDeployment):
        cls.register_type_and_schema()
        done.append(cls.get_block_type_slug())
    return done


def create_pools(*, kubernetes: bool = True) -> list[str]:
    """The process pool (a login node runs its worker) and, optionally, a Kubernetes pool."""
    wanted = [(PROCESS_POOL, "process")] + ([(KUBERNETES_POOL, "kubernetes")] if kubernetes else [])
    made = []
    for name, kind in wanted:
        prefect = [sys.executable, "-m", "prefect"]
        exists = subprocess.run([*prefect, "work-pool", "inspect", name], capture_output=True).returncode == 0
        if not exists:
            subprocess.run([*prefect, "work-pool", "create", name, "--type", kind], check=True, capture_output=True)
        made.append(name)
    return made
