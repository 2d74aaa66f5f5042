"""Prepare a Prefect server for posttrain: block types and the work pools prefect.yaml names."""

from __future__ import annotations

import subprocess
import sys

import httpx

PROCESS_POOL = "posttrain-process"
KUBERNETES_POOL = "posttrain-kubernetes"


class PrefectUnreachable(Exception):
    """No Prefect API answers at PREFECT_API_URL: one line naming the URL (userinfo masked)."""


def require_server() -> None:
    """Check that the Prefect API answers before any command talks to it, so a wrong or dead
    PREFECT_API_URL is one line naming it, not Prefect's 78-line ``httpx.ConnectError``
    traceback. Unset, Prefect runs a temporary local server itself: nothing to check."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from posttrain import redact

    url = PREFECT_API_URL.value()
    if not url:
        return
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is None:
        return
    shown = f"PREFECT_API_URL={redact.scrub(url)}"
    reason = " ".join(redact.scrub(f"{type(error).__name__}: {error}").split())
    if isinstance(error, httpx.HTTPStatusError):
        raise PrefectUnreachable(f"{shown}: a server answers, but not as a Prefect API ({reason}); the URL ends "
                                 "in /api, e.g. http://127.0.0.1:4200/api")
    raise PrefectUnreachable(f"{shown}: nothing answers there ({reason}); start the Prefect server "
                             "(prefect server start) or point PREFECT_API_URL at one")


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
