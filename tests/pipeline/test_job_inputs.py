"""The flows' start-of-run check of what the job reads (check-job-inputs): a base model path that
does not exist fails the run before anything is submitted, naming the parameter; a path off the
Slurm cluster's shared storage names the parameter and the block's fields; a launcher missing from
the job's PATH names the cluster block."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from posttrain.cluster import ConfigError, KubernetesConfig, LocalConfig, SlurmConfig
from posttrain.pipeline.blocks import KubernetesCluster, LocalCluster, SlurmCluster
from posttrain.pipeline.tasks import blocks


@pytest.fixture
def run_inputs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    return {"base_model": str(tmp_path / "model"), "dataset": str(tmp_path / "prompts.jsonl"),
            "shared_dir": str(tmp_path / "shared")}


def _cluster(monkeypatch, block) -> None:
    monkeypatch.setattr(blocks, "load_block", lambda ref, what: block)


def test_present_inputs_pass(monkeypatch, run_inputs):
    _cluster(monkeypatch, LocalCluster())
    blocks.check_job_inputs.fn("posttrain-local-cluster/default", **run_inputs)


def test_a_base_model_path_that_does_not_exist_fails_naming_it(monkeypatch, run_inputs):
    _cluster(monkeypatch, LocalCluster())
    with pytest.raises(ValueError, match=r"^base_model: /shared/models/nope does not exist \(checked on this machine"):
        blocks.check_job_inputs.fn("posttrain-local-cluster/default",
                                   **{**run_inputs, "base_model": "/shared/models/nope"})


def test_a_missing_launcher_names_the_cluster_block(monkeypatch, run_inputs, tmp_path):
    (tmp_path / "empty").mkdir()
    _cluster(monkeypatch, LocalCluster(settings=LocalConfig(launcher="torchrun", env={"PATH": str(tmp_path / "empty")})))
    with pytest.raises(ValueError, match=r"^cluster posttrain-local-cluster/x: launcher: torchrun is not on the job's PATH"):
        blocks.check_job_inputs.fn("posttrain-local-cluster/x", **run_inputs)


def test_kubernetes_inputs_are_checked_in_the_pvc_the_flow_mounts(monkeypatch, tmp_path):
    """The flow's machine mounts the PVC where the pods do (docs/site-setup.md): what the job reads
    must exist there, under pvc_mount; the dataset is read by the flow (staged into shared_dir)."""
    pvc = tmp_path / "pvc"
    (pvc / "models" / "base").mkdir(parents=True)
    (pvc / "models" / "base" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    _cluster(monkeypatch, KubernetesCluster(settings=KubernetesConfig(namespace="ml", image="r/p:1", pvc="shared",
                                                                      pvc_mount=str(pvc))))
    good = {"base_model": str(pvc / "models" / "base"), "dataset": str(tmp_path / "prompts.jsonl"),
            "shared_dir": str(pvc / "posttrain")}
    blocks.check_job_inputs.fn("posttrain-kubernetes-cluster/default", **good)
    with pytest.raises(ConfigError, match=rf"^base_model: {pvc}/models/nope does not exist \(checked on this "
                                          rf"machine, which mounts the PVC shared at {pvc} as the pods do\)"):
        blocks.check_job_inputs.fn("posttrain-kubernetes-cluster/default",
                                   **{**good, "base_model": str(pvc / "models" / "nope")})
    with pytest.raises(ConfigError, match=rf"^shared_dir: {tmp_path}/shared is not on the PVC \(under pvc_mount "
                                          rf"{pvc}\); the pods would not see it"):
        blocks.check_job_inputs.fn("posttrain-kubernetes-cluster/default", **{**good, "shared_dir": str(tmp_path / "shared")})


def test_slurm_paths_off_the_clusters_shared_storage_fail_naming_the_parameter_and_the_block_fields(
        monkeypatch, tmp_path):
    """docs/site-setup.md deployed base_model /shared/models/base and shared_dir /shared/posttrain
    with a Slurm block whose shared_dir was /mnt/shared: the run staged the dataset and passed these
    checks, then failed at submit with a pydantic error naming trainer.model_name_or_path. Now the
    check fails first, naming the flow parameter and the block's shared_dir and mounts."""
    shared, site = tmp_path / "shared", tmp_path / "site"
    for root in (shared, site):
        (root / "models" / "base").mkdir(parents=True)
        (root / "models" / "base" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text("{}\n")  # the flow reads it and stages it into shared_dir
    ref = "posttrain-slurm-cluster/default"
    settings = SlurmConfig(shared_dir=str(shared), launcher="python", time_limit="10")
    _cluster(monkeypatch, SlurmCluster(settings=settings))
    good = {"base_model": str(shared / "models" / "base"), "dataset": str(tmp_path / "prompts.jsonl"),
            "shared_dir": str(shared / "posttrain")}
    blocks.check_job_inputs.fn(ref, **good)
    fields = f"under neither shared_dir {shared} nor mounts (none) of block {ref}"
    with pytest.raises(ConfigError) as info:
        blocks.check_job_inputs.fn(ref, **{**good, "base_model": str(site / "models" / "base")})
    assert str(info.value) == (f"base_model: {site}/models/base is not on the cluster's shared storage ({fields}); "
                               "the nodes would not see it: move it there, or add its folder to mounts")
    with pytest.raises(ConfigError, match=rf"^shared_dir: {site}/posttrain is not on the cluster's shared storage "
                                          rf"\({re.escape(fields)}\)"):
        blocks.check_job_inputs.fn(ref, **{**good, "shared_dir": str(site / "posttrain")})
    with pytest.raises(ConfigError, match=rf"^ref_model_name_or_path: {site}/models/base is not on the cluster's "
                                          rf"shared storage \({re.escape(fields)}\)"):
        blocks.check_job_inputs.fn(ref, **good, ref_model=str(site / "models" / "base"))
    (shared / "models" / "linked").symlink_to(site / "models" / "base")  # a link on shared storage, pointing off it
    with pytest.raises(ConfigError) as info:
        blocks.check_job_inputs.fn(ref, **{**good, "base_model": str(shared / "models" / "linked")})
    assert str(info.value).startswith(f"base_model: {shared}/models/linked resolves to {site}/models/base, which is "
                                      f"not on the cluster's shared storage ({fields}): a link points off it")
    # a mount of the block makes the site's folder shared storage
    _cluster(monkeypatch, SlurmCluster(settings=settings.model_copy(update={"mounts": [str(site)]})))
    blocks.check_job_inputs.fn(ref, **{**good, "base_model": str(shared / "models" / "linked")},
                               ref_model=str(site / "models" / "base"))


def test_an_empty_base_model_folder_fails_naming_it_and_the_missing_file(monkeypatch, run_inputs, tmp_path):
    _cluster(monkeypatch, LocalCluster())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^base_model: .*/empty has no config.json: not a Hugging Face model folder"):
        blocks.check_job_inputs.fn("posttrain-local-cluster/default",
                                   **{**run_inputs, "base_model": str(tmp_path / "empty")})


def test_the_reference_model_is_checked_when_the_run_loads_one(monkeypatch, run_inputs):
    """With beta > 0 the job loads ref_model_name_or_path in round 0; a wrong path failed it there."""
    from posttrain.pipeline.settings import GrpoSettings

    _cluster(monkeypatch, LocalCluster())
    base = {"run_name": "grpo", **run_inputs}
    assert GrpoSettings(**base, trainer={"ref_model_name_or_path": "/models/ref"}).ref_model is None  # beta 0: unused
    settings = GrpoSettings(**base, trainer={"beta": 0.1, "ref_model_name_or_path": "/models/ref"})
    assert settings.ref_model == "/models/ref"
    with pytest.raises(ValueError, match=r"^ref_model_name_or_path: /models/ref does not exist \(checked on this"):
        blocks.check_job_inputs.fn("posttrain-local-cluster/default", **run_inputs, ref_model=settings.ref_model)
    blocks.check_job_inputs.fn("posttrain-local-cluster/default", **run_inputs, ref_model=run_inputs["base_model"])


def test_a_dask_scheduler_that_does_not_answer_fails_naming_dask_address():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=rf"^dask_address: nothing answers at tcp://127.0.0.1:{port} \("):
        blocks.check_dask_scheduler.fn(f"tcp://127.0.0.1:{port}")


def _http_error(status: int):
    import httpx

    request = httpx.Request("GET", "http://127.0.0.1:4200/api/block_documents")
    return httpx.HTTPStatusError(f"{status}", request=request, response=httpx.Response(status, request=request))


def _failing(calls: list, error: Exception):
    def load(ref):
        calls.append(ref)
        raise error

    return load


def test_a_block_load_that_meets_a_failing_prefect_api_is_tried_again(monkeypatch):
    """A Prefect server whose database restarts answers 500 for a few seconds: the block is loaded
    again (a soak found a nightly run failed by one); a block that is not there fails at once."""
    import httpx
    from prefect.blocks.core import Block

    calls, block = [], object()

    def load(ref):
        calls.append(ref)
        if len(calls) < 3:
            raise _http_error(500) if len(calls) == 1 else httpx.ConnectError("refused")
        return block

    monkeypatch.setattr(Block, "load", staticmethod(load))
    monkeypatch.setattr(blocks.time, "sleep", lambda s: None)
    assert blocks.load_block("slurm-cluster/site", "cluster") is block and len(calls) == 3

    calls.clear()
    monkeypatch.setattr(Block, "load", staticmethod(_failing(calls, ValueError("Unable to find block document named site"))))
    with pytest.raises(ValueError, match="cluster: cannot load block 'slurm-cluster/site'.*Unable to find"):
        blocks.load_block("slurm-cluster/site", "cluster")
    assert len(calls) == 1  # not a transient failure: no second try

    calls.clear()
    monkeypatch.setattr(Block, "load", staticmethod(_failing(calls, _http_error(503))))
    with pytest.raises(ValueError, match="cluster: cannot load block .*503"):
        blocks.load_block("slurm-cluster/site", "cluster", retry_s=0.5)
    assert len(calls) == 1  # the backoff (1 s) does not fit in 0.5 s: given up, named
