"""The ``posttrain-kubernetes`` work pool that ``posttrain prefect-setup`` creates: its flow-run pod
mounts the training jobs' PVC at ``pvc_mount``, as the training pods do, so the flow stages the
dataset, writes the rounds and watches the checkpoints at the jobs' own paths (docs/site-setup.md).

Rendered as Prefect's Kubernetes worker renders it (``apply_values`` over the variables' defaults
and the deployment's job variables) from Prefect's default template (a golden copy of what the server
hands out, ``golden/``), and validated against the official schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prefect.utilities.templating import apply_values

from posttrain.pipeline.deployments.setup import SHARED_VOLUME, with_shared_pvc

REPO = Path(__file__).resolve().parents[2]
DEFAULT = Path(__file__).parent / "golden" / "prefect-kubernetes-base-job-template.json"


def _nightly_k8s_variables(env: dict[str, str]) -> dict:
    """nightly-k8s's job variables in prefect.yaml, with ``{{ $VAR }}`` read from ``env`` as ``prefect deploy`` does."""
    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    k8s = next(d for d in doc["deployments"] if d["name"] == "nightly-k8s")
    text = json.dumps(k8s["work_pool"]["job_variables"])
    return json.loads(re.sub(r"\{\{ \$(\w+) \}\}", lambda m: env[m.group(1)], text))


def _render(template: dict, values: dict) -> dict:
    """The Job the worker submits: the template filled in, then the container's env a list of
    name/value pairs and its args a list (the worker's own steps after filling in)."""
    variables = {k: p["default"] for k, p in template["variables"]["properties"].items() if "default" in p}
    job = apply_values(template["job_configuration"], {**variables, **values})["job_manifest"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in container["env"].items()]
    container["args"] = container["args"].split()
    return job


@pytest.mark.parametrize("mount", [None, "/mnt/shared"])
def test_the_flow_run_pod_mounts_the_jobs_pvc(mount):
    template = with_shared_pvc(json.loads(DEFAULT.read_text()))
    assert "pvc" in template["variables"]["required"]
    values = _nightly_k8s_variables({"POSTTRAIN_IMAGE": "registry/posttrain:1", "POSTTRAIN_PVC": "shared-vast"})
    assert values == {"image": "registry/posttrain:1", "pvc": "shared-vast",
                      "env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}}
    if mount:
        values["pvc_mount"] = mount
    job = _render(template, {**values, "name": "nightly-k8s-run", "namespace": "ml-team",
                             "command": "prefect flow-run execute"})
    pod = job["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": "shared-vast"}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": SHARED_VOLUME, "mountPath": mount or "/data"}]
    version = kubernetes_validate.utils.latest_version()
    assert kubernetes_validate.validate(job, version, strict=True) == version.rsplit(".", 1)[0]


def test_prefects_own_variables_are_kept():
    default = json.loads(DEFAULT.read_text())
    template = with_shared_pvc(default)
    assert set(template["variables"]["properties"]) == {*default["variables"]["properties"], "pvc", "pvc_mount"}
    assert with_shared_pvc(template) == template  # idempotent: prefect-setup may run again
    assert "volumes" not in default["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]  # a copy
