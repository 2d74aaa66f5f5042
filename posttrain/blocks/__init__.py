"""Prefect Block types of posttrain: ``prefect block register -m posttrain.blocks``."""

from posttrain.blocks.clusters import KubernetesCluster, LocalCluster, SlurmCluster
from posttrain.blocks.inference import InferenceDeployment
from posttrain.blocks.storage import ObjectStore

__all__ = ["InferenceDeployment", "KubernetesCluster", "LocalCluster", "ObjectStore", "SlurmCluster"]
