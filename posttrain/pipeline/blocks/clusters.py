"""Blocks for where training runs: a Slurm cluster, a Kubernetes cluster, this machine."""

from __future__ import annotations

from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import Field

from posttrain.cluster import KubernetesConfig, LocalConfig, SlurmConfig


class _ClusterBlock(Block):
    def backend(self):
        """The cluster backend (submit, render, attach) for these settings."""
        from posttrain.cluster import open_backend

        return open_backend(self.settings)


class SlurmCluster(_ClusterBlock):
    """A Slurm cluster (CoreWeave SUNK or any Slurm with pyxis/enroot) reached through submitit."""

    _block_type_name: ClassVar[str] = "posttrain Slurm Cluster"
    _block_type_slug: ClassVar[str] = "posttrain-slurm-cluster"
    _description: ClassVar[str] = "Where posttrain submits training jobs with sbatch (submitit), over ssh if needed."
    _code_example: ClassVar[str] = """
```python
from posttrain.pipeline.blocks import SlurmCluster
from posttrain.cluster import SlurmConfig

SlurmCluster(settings=SlurmConfig(shared_dir="/mnt/shared", partition="h100", nodes=1,
                                  gpus_per_node=8, image="/mnt/shared/images/posttrain.sqsh")).save("sunk")
```
"""

    settings: SlurmConfig = Field(description="Slurm settings, named as on CoreWeave SUNK.")


class KubernetesCluster(_ClusterBlock):
    """A Kubernetes cluster (CoreWeave CKS): one Indexed Job per training run."""

    _block_type_name: ClassVar[str] = "posttrain Kubernetes Cluster"
    _block_type_slug: ClassVar[str] = "posttrain-kubernetes-cluster"
    _description: ClassVar[str] = "Where posttrain runs training as an Indexed Job with a headless Service."
    _code_example: ClassVar[str] = """
```python
from posttrain.pipeline.blocks import KubernetesCluster
from posttrain.cluster import KubernetesConfig

KubernetesCluster(settings=KubernetesConfig(namespace="tenant", image="registry/posttrain:1", pvc="shared",
                                            nodes=2, gpus_per_node=8)).save("cks")
```
"""

    settings: KubernetesConfig = Field(description="Kubernetes settings, named as on CoreWeave CKS.")


class LocalCluster(_ClusterBlock):
    """This machine, through submitit's LocalExecutor: the embedded default."""

    _block_type_name: ClassVar[str] = "posttrain Local Cluster"
    _block_type_slug: ClassVar[str] = "posttrain-local-cluster"
    _description: ClassVar[str] = "Runs training as a local process on the machine of the flow."
    _code_example: ClassVar[str] = """
```python
from posttrain.pipeline.blocks import LocalCluster

LocalCluster().save("default")
```
"""

    settings: LocalConfig = Field(default_factory=LocalConfig, description="Local process settings.")
