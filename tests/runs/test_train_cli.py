"""`posttrain train`: settings (cluster: + trainer:) -> the trainer's JobSpec; dry runs contact nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.runs.job import SettingsError, parse_training_settings, training_job_spec
from posttrain.trainer.config import TrainerConfig

SLURM = {"shared_dir": "/mnt/shared", "image": "ghcr.io/example/posttrain:1.0", "nodes": 2,
         "python": "/opt/venv/bin/python", "env": {"HF_HUB_OFFLINE": "1"}}  # fmt: skip
K8S = {"namespace": "ml", "image": "ghcr.io/example/posttrain:1.0", "pvc": "shared-vast", "nodes": 2}


def _trainer(root: str) -> dict:
    return {
        "model_name_or_path": f"{root}/models/tiny",
        "output_dir": f"{root}/runs/nightly",
        "dataset_manifest": f"{root}/datasets/abc/manifest.json",
        "reward_funcs": ["posttrain.rewards:correctness_reward"],
        "learning_rate": 1.0e-5,
        "max_steps": 20,
        "save_steps": 5,
    }


def _write(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_slurm_dry_run_prints_the_script_the_srun_line_and_trainer_yaml(tmp_path, capsys, no_contact) -> None:
    doc = {"name": "grpo-nightly", "cluster": SLURM, "trainer": _trainer("/mnt/shared")}
    assert main(["train", _write(tmp_path, doc), "--backend", "slurm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in out and "#SBATCH --requeue" in out
    assert "# ---- srun line (in sbatch.sh)\nsrun --unbuffered" in out
    assert "--container-image=docker://ghcr.io#example/posttrain:1.0" in out
    assert "export HF_HUB_OFFLINE=1" in out
    node_command = out.split("# ---- node command (each task runs it under submitit)\n")[1].splitlines()[0]
    assert node_command.startswith("torchrun --nnodes=2 ")
    assert " -m posttrain.trainer /mnt/shared/posttrain-jobs/grpo-nightly-" in node_command
    assert "/trainer.yaml --result-file /mnt/shared/runs/nightly/.posttrain/grpo-nightly-" in node_command
    trainer_yaml = out.split("/trainer.yaml\n# written by posttrain train")[1]
    assert "learning_rate: 1.0e-05" in trainer_yaml and "output_dir: /mnt/shared/runs/nightly" in trainer_yaml
    assert not list(tmp_path.glob("posttrain-jobs*"))


def test_k8s_dry_run_prints_applicable_manifests(tmp_path, capsys, no_contact) -> None:
    doc = {"backend": "k8s", "name": "grpo-nightly", "cluster": K8S, "trainer": _trainer("/data")}
    assert main(["train", _write(tmp_path, doc), "--dry-run"]) == 0
    out = capsys.readouterr().out
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["kind"] for d in docs] == ["Service", "ConfigMap", "Job"]
    configmap = docs[1]["data"]
    assert TrainerConfig.model_validate(yaml.safe_load(configmap["trainer.yaml"])).max_steps == 20
    assert "exec torchrun --nnodes=2 " in out
    assert " -m posttrain.trainer /posttrain-job/trainer.yaml --result-file /data/runs/nightly/.posttrain/" in out


@pytest.mark.parametrize(
    ("backend", "change", "named"),
    [
        ("slurm", {"cluster": {**SLURM, "nodes": 0}}, "cluster.nodes"),
        ("slurm", {"cluster": {**SLURM, "env": {"MASTER_ADDR": "x"}}}, "cluster.env"),
        ("slurm", {"trainer": {**_trainer("/mnt/shared"), "output_dir": "/home/me/out"}}, "trainer.output_dir"),
        ("slurm", {"trainer": {**_trainer("/mnt/shared"), "model_name_or_path": "/opt/m"}},
         "trainer.model_name_or_path"),
        ("slurm", {"trainer": {**_trainer("/mnt/shared"), "max_steps": 0}}, "trainer.max_steps"),
        ("slurm", {"trainer": {**_trainer("/mnt/shared"), "lr": 1.0}}, "trainer.lr"),
        ("k8s", {"cluster": K8S}, "trainer.output_dir"),  # /mnt/shared is not on the PVC
        ("k8s", {"cluster": {**K8S, "env_file": "/data/env"}}, "cluster"),
        ("slurm", {"name": "Bad_Name"}, "name"),
        ("slurm", {"jobs": []}, "jobs"),
    ],
)  # fmt: skip
def test_errors_name_the_field(tmp_path, capsys, no_contact, backend, change, named) -> None:
    doc = {"cluster": SLURM, "trainer": _trainer("/mnt/shared"), **change}
    assert main(["train", _write(tmp_path, doc), "--backend", backend, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"\n{named}" in err or f" {named}:" in err, err


def test_spec_runs_the_trainer_with_the_configured_python() -> None:
    trainer = _trainer("/mnt/shared")
    slurm = parse_training_settings({"name": "a", "run_id": "r1", "cluster": SLURM, "trainer": trainer}, "slurm")
    spec = training_job_spec(slurm)
    assert spec.command == [
        "/opt/venv/bin/python", "-m", "posttrain.trainer", "{job_dir}/trainer.yaml",
        "--result-file", "/mnt/shared/runs/nightly/.posttrain/a-r1.results.jsonl",
    ]  # fmt: skip
    assert (spec.name, spec.run_id, spec.output_dir) == ("a", "r1", "/mnt/shared/runs/nightly")
    assert TrainerConfig.model_validate(yaml.safe_load(spec.files["trainer.yaml"])) == slurm.trainer
    assert slurm.local_output_dir == Path("/mnt/shared/runs/nightly")

    local = parse_training_settings({"cluster": {"folder": "/tmp/jobs"}, "trainer": trainer})
    assert training_job_spec(local).command[0] == sys.executable and local.backend == "local"
    k8s = parse_training_settings({"cluster": K8S, "trainer": _trainer("/data"), "python": "python3"}, "k8s")
    assert training_job_spec(k8s).command[0] == "python3" and k8s.local_output_dir is None
    ssh = parse_training_settings({"cluster": {**SLURM, "ssh_host": "login"}, "trainer": trainer}, "slurm")
    assert ssh.local_output_dir is None
    with pytest.raises(SettingsError, match="^backend: 'nomad'"):
        parse_training_settings({"cluster": {}, "trainer": trainer}, "nomad")


def test_without_a_backend_the_error_says_local_was_used(tmp_path, capsys, no_contact) -> None:
    doc = {"cluster": SLURM, "trainer": _trainer("/mnt/shared")}  # Slurm settings, no backend anywhere
    assert main(["train", _write(tmp_path, doc), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "cluster.image: Extra inputs are not permitted" in err
    (line,) = [x for x in err.splitlines() if x.startswith("backend:")]
    assert "the local backend was used" in line and "--backend" in line
    # with a backend given, the line is not there
    assert main(["train", _write(tmp_path, {**doc, "cluster": {**SLURM, "nodes": 0}}), "--backend", "slurm",
                 "--dry-run"]) == 2
    assert "local backend" not in capsys.readouterr().err


def test_submit_without_a_backend_says_local_was_used(tmp_path, capsys, no_contact) -> None:
    path = tmp_path / "submit.yaml"
    path.write_text(yaml.safe_dump({"cluster": SLURM, "job": {"name": "j", "command": ["python", "x.py"]}}))
    assert main(["submit", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "cluster.image" in err and "the local backend was used" in err
