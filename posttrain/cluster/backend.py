"""``open_backend``: the backend for a validated cluster config. Backend modules (submitit,
kubernetes) are imported only when their backend is opened."""

from __future__ import annotations

from posttrain.cluster.config import ClusterConfig, KubernetesConfig, LocalConfig, SlurmConfig
from posttrain.cluster.spec import Backend


def open_backend(config: ClusterConfig | None = None) -> Backend:
    """Slurm, Kubernetes or local (the default, when ``config`` is None)."""
    if config is None or isinstance(config, LocalConfig):
        from posttrain.cluster.local import LocalBackend

        return LocalBackend(config)
    if isinstance(config, SlurmConfig):
        from posttrain.cluster.slurm import SlurmBackend

        return SlurmBackend(config)
    if isinstance(config, KubernetesConfig):
        from posttrain.cluster.k8s import KubernetesBackend

        return KubernetesBackend(config)
    raise TypeError(f"not a cluster config: {type(config).__name__}")
