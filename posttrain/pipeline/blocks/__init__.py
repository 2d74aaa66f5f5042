"""Prefect Block types of posttrain: ``prefect block register -m posttrain.pipeline.blocks``."""

from posttrain.pipeline.blocks.clusters import KubernetesCluster, LocalCluster, SlurmCluster
from posttrain.pipeline.blocks.inference import InferenceDeployment
from posttrain.pipeline.blocks.storage import ObjectStore

__all__ = ["InferenceDeployment", "KubernetesCluster", "LocalCluster", "ObjectStore", "SlurmCluster"]
