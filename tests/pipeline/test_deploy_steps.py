"""prefect.yaml's deploy-time checks: the Kubernetes deployment needs $POSTTRAIN_IMAGE."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.pipeline.deployments.steps import require_env

REPO = Path(__file__).resolve().parents[2]


def test_require_env_names_what_is_missing(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_IMAGE", raising=False)
    with pytest.raises(ValueError, match=r"^set POSTTRAIN_IMAGE before deploying \(the pods' image\)"):
        require_env(["POSTTRAIN_IMAGE"], "the pods' image")
    monkeypatch.setenv("POSTTRAIN_IMAGE", "")
    with pytest.raises(ValueError, match="set POSTTRAIN_IMAGE"):
        require_env(["POSTTRAIN_IMAGE"])
    monkeypatch.setenv("POSTTRAIN_IMAGE", "registry/posttrain:1")
    assert require_env(["POSTTRAIN_IMAGE"]) == {"POSTTRAIN_IMAGE": "registry/posttrain:1"}


def test_the_kubernetes_deployment_requires_its_image():
    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    k8s = next(d for d in doc["deployments"] if d["name"] == "nightly-k8s")
    assert k8s["work_pool"]["job_variables"]["image"] == "{{ $POSTTRAIN_IMAGE }}"
    step = next(s["posttrain.pipeline.deployments.steps.require_env"] for s in k8s["build"]
                if "posttrain.pipeline.deployments.steps.require_env" in s)
    assert step["names"] == ["POSTTRAIN_IMAGE"]
