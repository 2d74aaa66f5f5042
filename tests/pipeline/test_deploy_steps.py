"""prefect.yaml's deploy-time checks: the Kubernetes deployment needs $POSTTRAIN_IMAGE and
$POSTTRAIN_PVC, and `prefect deploy --all` without them stops with one line before it has made any
deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.pipeline.deployments.setup import with_shared_pvc
from posttrain.pipeline.deployments.steps import DeployStopped, require_env

REPO = Path(__file__).resolve().parents[2]
STEP = "posttrain.pipeline.deployments.steps.require_env"


def test_require_env_names_what_is_missing(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_IMAGE", raising=False)
    with pytest.raises(DeployStopped) as info:
        require_env(["POSTTRAIN_IMAGE"], "the pods' image")
    # SystemExit's code is the message Python prints, as one line, before exiting 1
    assert isinstance(info.value, SystemExit) and not isinstance(info.value, Exception)
    assert str(info.value.code).startswith("set POSTTRAIN_IMAGE before deploying (the pods' image)")
    assert "\n" not in str(info.value.code)
    monkeypatch.setenv("POSTTRAIN_IMAGE", "")
    with pytest.raises(DeployStopped, match="set POSTTRAIN_IMAGE"):
        require_env(["POSTTRAIN_IMAGE"])
    monkeypatch.setenv("POSTTRAIN_IMAGE", "registry/posttrain:1")
    assert require_env(["POSTTRAIN_IMAGE"]) == {"POSTTRAIN_IMAGE": "registry/posttrain:1"}


def test_the_suggestion_without_kubernetes_deploys_every_other_deployment(monkeypatch):
    """It named only nightly and grpo: promote and rollback, which the README and
    docs/promotion.md run, did not exist until deployed separately (issue 37, item 2)."""
    monkeypatch.delenv("POSTTRAIN_IMAGE", raising=False)
    monkeypatch.chdir(REPO)  # prefect deploy runs where prefect.yaml is
    with pytest.raises(DeployStopped) as info:
        require_env(["POSTTRAIN_IMAGE"])
    suggestion = str(info.value.code).split("deploy the others alone: ", 1)[1]
    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    others = [d["name"] for d in doc["deployments"] if d["name"] != "nightly-k8s"]
    assert {"nightly", "grpo", "promote", "rollback"} <= set(others)
    assert suggestion == "prefect --no-prompt deploy " + " ".join(f"--name {n}" for n in others)
    # docs/site-setup.md quotes the line as printed
    assert str(info.value.code).split(". Without")[1] in (REPO / "docs" / "site-setup.md").read_text()


def test_the_kubernetes_deployment_requires_its_image_and_comes_first():
    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    k8s = next(d for d in doc["deployments"] if d["name"] == "nightly-k8s")
    assert k8s["work_pool"]["job_variables"]["image"] == "{{ $POSTTRAIN_IMAGE }}"
    assert k8s["work_pool"]["job_variables"]["pvc"] == "{{ $POSTTRAIN_PVC }}"
    step = next(s[STEP] for s in k8s["build"] if STEP in s)
    assert step["names"] == ["POSTTRAIN_IMAGE", "POSTTRAIN_PVC"]
    # deploy --all deploys in file order: the deployment whose check can stop it goes first
    assert doc["deployments"][0]["name"] == "nightly-k8s"


def test_deploy_all_without_the_image_is_one_line_and_deploys_nothing(prefect_api, tmp_path):
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    def updated() -> dict[str, object]:
        seen = {}
        with get_client(sync_client=True) as client:
            for name in ("nightly-post-training/nightly", "grpo/grpo", "nightly-post-training/nightly-k8s"):
                try:
                    seen[name] = client.read_deployment_by_name(name).updated
                except ObjectNotFound:
                    seen[name] = None
        return seen

    setup = subprocess.run([sys.executable, "-m", "posttrain", "prefect-setup"], capture_output=True, text=True,
                           timeout=180)
    assert setup.returncode == 0, setup.stderr
    with get_client(sync_client=True) as client:  # the Kubernetes pool's flow-run pod mounts the jobs' PVC
        pool = client.read_work_pool("posttrain-kubernetes").base_job_template
    golden = json.loads((REPO / "tests" / "pipeline" / "golden" / "prefect-kubernetes-base-job-template.json").read_text())
    assert pool == with_shared_pvc(golden)  # tests/pipeline/test_kubernetes_pool.py renders it
    before = updated()
    env = {k: v for k, v in os.environ.items() if k not in ("POSTTRAIN_IMAGE", "POSTTRAIN_PVC")}
    env.update({"PWD": str(REPO), "POSTTRAIN_BASE_MODEL": str(tmp_path / "model"),
                "POSTTRAIN_DATASET": str(tmp_path / "prompts.jsonl"), "POSTTRAIN_SHARED_DIR": str(tmp_path)})
    deploy = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=180)
    assert deploy.returncode == 1
    assert "Traceback" not in deploy.stdout + deploy.stderr
    assert deploy.stderr.strip().splitlines() == [
        deploy.stderr.strip().splitlines()[-1]], deploy.stderr  # one line on stderr
    assert deploy.stderr.strip().startswith("set POSTTRAIN_IMAGE, POSTTRAIN_PVC before deploying")
    assert updated() == before
