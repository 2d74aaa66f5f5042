"""Prepare a Prefect server for posttrain: block types and the work pools prefect.yaml names."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile

import httpx

PROCESS_POOL = "posttrain-process"
KUBERNETES_POOL = "posttrain-kubernetes"
#: The flow-run pod's volume of the training jobs' PVC (``with_shared_pvc``).
SHARED_VOLUME = "posttrain-shared"


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


def with_shared_pvc(template: dict) -> dict:
    """A Kubernetes work pool's base job template whose flow-run pod mounts the training jobs' PVC
    (variables ``pvc``, required, and ``pvc_mount``, default ``/data``, as ``KubernetesConfig``'s):
    the flow stages the dataset and writes the rounds where the pods read them, and watches their
    checkpoints, at the same paths (docs/site-setup.md)."""
    template = copy.deepcopy(template)
    variables = template["variables"]
    variables["properties"]["pvc"] = {
        "title": "PVC", "type": "string",
        "description": "The ReadWriteMany PersistentVolumeClaim of the training jobs (the cluster block's pvc).",
    }
    variables["properties"]["pvc_mount"] = {
        "title": "PVC mount", "type": "string", "default": "/data",
        "description": "Where the flow-run pod mounts it: the cluster block's pvc_mount, as the training pods do.",
    }
    variables["required"] = sorted({*variables.get("required", []), "pvc"})
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    # Prefect's default puts these Job fields in the pod spec, where the API server drops them with
    # a warning (and a strict validation refuses the Job); a Job's own defaults are these values.
    for misplaced, value in (("parallelism", 1), ("completions", 1)):
        if pod.get(misplaced, value) == value:
            pod.pop(misplaced, None)
    pod["volumes"] = [{"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": "{{ pvc }}"}}]
    pod["containers"][0]["volumeMounts"] = [{"name": SHARED_VOLUME, "mountPath": "{{ pvc_mount }}"}]
    return template


def kubernetes_pool_template() -> dict:
    """Prefect's default base job template of a ``kubernetes`` pool (from the server's worker
    registry: prefect-kubernetes need not be installed here), with the shared PVC mounted."""
    from prefect.utilities.asyncutils import run_coro_as_sync
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    default = run_coro_as_sync(get_default_base_job_template_for_infrastructure_type("kubernetes"))
    if not default:
        raise RuntimeError("the Prefect server has no default base job template for kubernetes work pools")
    return with_shared_pvc(default)


def create_pools(*, kubernetes: bool = True) -> list[str]:
    """The process pool (a login node runs its worker) and, optionally, a Kubernetes pool whose
    flow-run pods mount the jobs' PVC (``with_shared_pvc``; an existing pool without it gains it)."""
    wanted = [(PROCESS_POOL, "process")] + ([(KUBERNETES_POOL, "kubernetes")] if kubernetes else [])
    prefect = [sys.executable, "-m", "prefect"]
    made = []
    for name, kind in wanted:
        inspect = subprocess.run([*prefect, "work-pool", "inspect", name], capture_output=True, text=True)
        exists = inspect.returncode == 0
        if kind != "kubernetes":
            if not exists:
                subprocess.run([*prefect, "work-pool", "create", name, "--type", kind], check=True,
                               capture_output=True)
        elif not exists or not _mounts_shared_pvc(name):
            with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
                json.dump(kubernetes_pool_template(), f)
                f.flush()
                action = ["update", name] if exists else ["create", name, "--type", kind]
                subprocess.run([*prefect, "work-pool", *action, "--base-job-template", f.name], check=True,
                               capture_output=True)
        made.append(name)
    return made


def _mounts_shared_pvc(pool: str) -> bool:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
    return "pvc" in template.get("variables", {}).get("properties", {})
