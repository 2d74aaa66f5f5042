"""`posttrain submit`: one YAML file, any backend, errors that name the field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main


def _write(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "submit.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


SLURM = {"shared_dir": "/mnt/shared", "image": "ghcr.io/example/posttrain:1.0", "nodes": 2}
K8S = {"namespace": "ml", "image": "ghcr.io/example/posttrain:1.0", "pvc": "shared-vast", "nodes": 2}
JOB = {"name": "grpo", "command": ["python", "-m", "posttrain.trainer", "{job_dir}/trainer.yaml"],
       "files_from": {"trainer.yaml": "trainer.yaml"}}  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "cluster", "marker"), [("slurm", SLURM, "srun --unbuffered"), ("k8s", K8S, "kind: Job")]
)
def test_dry_run_prints_what_would_be_submitted(tmp_path, capsys, no_contact, backend, cluster, marker) -> None:
    (tmp_path / "trainer.yaml").write_text("learning_rate: 1.0e-6\n")
    config = _write(tmp_path, {"cluster": cluster, "job": JOB})
    assert main(["submit", config, "--backend", backend, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert marker in out and "learning_rate: 1.0e-6" in out


def test_backend_from_the_file_and_dry_run_setting(tmp_path, capsys, no_contact) -> None:
    (tmp_path / "trainer.yaml").write_text("x: 1\n")
    config = _write(tmp_path, {"backend": "k8s", "cluster": {**K8S, "dry_run": True}, "job": JOB})
    assert main(["submit", config]) == 0
    assert "kind: Service" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("doc", "named"),
    [
        ({"backend": "slurm", "cluster": {**SLURM, "env": {"MASTER_ADDR": "x"}}, "job": JOB}, "cluster.env"),
        ({"backend": "slurm", "cluster": {**SLURM, "nodes": 0}, "job": JOB}, "cluster.nodes"),
        ({"backend": "k8s", "cluster": {**K8S, "job_name": "Bad_Name"}, "job": JOB}, "cluster.job_name"),
        ({"backend": "k8s", "cluster": {k: v for k, v in K8S.items() if k != "image"}, "job": JOB}, "cluster.image"),
        ({"backend": "slurm", "cluster": SLURM, "job": {**JOB, "name": "Bad"}}, "job.name"),
        ({"backend": "slurm", "cluster": SLURM, "job": {**JOB, "output_dir": "/tmp/out"}}, "job.output_dir"),
        ({"backend": "slurm", "cluster": SLURM, "job": {**JOB, "files_from": {"a.yaml": "missing.yaml"}}}, "job.files_from.a.yaml"),
        ({"backend": "nomad", "cluster": {}, "job": JOB}, "backend"),
        ({"cluster": {}, "job": JOB, "jobs": []}, "jobs"),
    ],
)  # fmt: skip
def test_errors_name_the_field(tmp_path, capsys, no_contact, doc, named) -> None:
    (tmp_path / "trainer.yaml").write_text("x: 1\n")
    assert main(["submit", _write(tmp_path, doc), "--dry-run"]) == 2
    assert named in capsys.readouterr().err


def test_local_submit_runs_to_the_end(tmp_path, capsys) -> None:
    doc = {
        "backend": "local",
        "cluster": {"folder": str(tmp_path / "jobs"), "poll_interval_s": 0.2},
        "job": {"name": "smoke", "command": [sys.executable, "-m", "posttrain.cluster.smoke", "--steps", "2",
                                             "--sleep", "0.05", "--state", "{job_dir}/state.json"]},
    }  # fmt: skip
    assert main(["submit", _write(tmp_path, doc)]) == 0
    captured = capsys.readouterr()
    assert "step 2" in captured.out
    assert "ended COMPLETED" in captured.err


def test_local_failure_exits_1_with_the_reason(tmp_path, capsys) -> None:
    doc = {
        "cluster": {"folder": str(tmp_path / "jobs"), "poll_interval_s": 0.2},
        "job": {"name": "fails", "command": [sys.executable, "-m", "posttrain.cluster.smoke", "--fail-at", "1",
                                             "--sleep", "0.05", "--state", "{job_dir}/state.json"]},
    }  # fmt: skip
    assert main(["submit", _write(tmp_path, doc)]) == 1
    err = capsys.readouterr().err
    assert "ended FAILED" in err and "failing at step 1 as asked" in err


def _documented_submit_example() -> dict:
    """The submit file docs/commands.md shows after "posttrain submit runs any command as a job"."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "commands.md").read_text()
    section = page.split("`posttrain submit` runs any command as a job", 1)[1]
    return yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])


def test_the_documented_submit_example_renders_as_written(tmp_path, capsys, no_contact) -> None:
    doc = _documented_submit_example()
    (tmp_path / "trainer.yaml").write_text("learning_rate: 1.0e-6\n")
    assert main(["submit", _write(tmp_path, doc), "--dry-run"]) == 0
    assert "torchrun --nnodes=2" in capsys.readouterr().out


def test_a_slurm_cluster_without_image_runs_on_the_nodes_own_environment(tmp_path, capsys, no_contact) -> None:
    doc = _documented_submit_example()
    del doc["cluster"]["image"]
    (tmp_path / "trainer.yaml").write_text("x: 1\n")
    assert main(["submit", _write(tmp_path, doc), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "srun --unbuffered" in out and "--container-image" not in out


@pytest.mark.parametrize(("cluster", "expected"), [
    ({"launcher": "python", "nodes": 1}, "bash run.sh"),
    ({"launcher_args": ["--no-python"]}, "--no-python bash run.sh"),
    ({"launcher": "accelerate", "launcher_args": ["--no_python"]}, "--no_python bash run.sh"),
])  # fmt: skip
def test_any_program_runs_with_the_launcher_rules_the_docs_give(tmp_path, capsys, no_contact, cluster,
                                                                 expected) -> None:
    doc = _documented_submit_example()
    doc["cluster"].update(cluster)
    doc["job"] = {"name": "any", "command": ["bash", "run.sh"]}
    assert main(["submit", _write(tmp_path, doc), "--dry-run"]) == 0
    assert expected in capsys.readouterr().out


def test_another_program_under_torchrun_is_refused_with_the_ways_out(tmp_path, capsys, no_contact) -> None:
    doc = _documented_submit_example()
    doc["job"] = {"name": "any", "command": ["bash", "run.sh"]}
    assert main(["submit", _write(tmp_path, doc), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "not 'bash'" in err and "launcher: python" in err and "--no-python" in err
