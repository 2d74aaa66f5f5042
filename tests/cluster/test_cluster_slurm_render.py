"""Slurm rendering (golden files), dry runs, the ssh command line and sbatch retries: no cluster."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path
from typing import Any

import pytest

from posttrain.cluster import JobSpec, SlurmConfig, SubmissionError, job_secrets, open_backend
from posttrain.cluster.launch import Topology, launch_line
from posttrain.cluster.shell import LocalShell, SshShell
from posttrain.cluster.slurm import NODE_FILE, SlurmBackend, slurm_state
from posttrain.cluster.spec import JobState

SHARED = "/mnt/shared"


def representative_config(**change: Any) -> SlurmConfig:
    return SlurmConfig(
        **{
            "shared_dir": SHARED,
            "image": "ghcr.io/example/posttrain:1.0",
            "partition": "h100",
            "account": "ml-team",
            "qos": "normal",
            "nodes": 2,
            "gpus_per_node": 8,
            "cpus_per_task": 64,
            "memory": "0",
            "time_limit": "12:00:00",
            "mounts": ["/mnt/data"],
            "env_file": f"{SHARED}/secrets/train.env",
            "env": {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
            "secrets": ["GITHUB_PAT", "DB_PASS"],
            "launcher": "torchrun",
            "setup_commands": ["nvidia-smi -L"],
            **change,
        }
    )


def representative_spec(**change: Any) -> JobSpec:
    return JobSpec(
        **{
            "name": "grpo-nightly",
            "run_id": "20250101-000000-abcd",
            "command": ["python", "-m", "posttrain.trainer", "{job_dir}/trainer.yaml"],
            "files": {"trainer.yaml": "model: Qwen/Qwen2.5-0.5B-Instruct\nlearning_rate: 1.0e-6\n"},
            "output_dir": "/mnt/data/runs/grpo-nightly",
            "env": {"RUN_LABEL": "nightly"},
            **change,
        }
    )


def _sbatch_and_node(config: SlurmConfig, spec: JobSpec) -> tuple[str, str]:
    backend = SlurmBackend(config)
    checked = backend.check(spec)
    ex = backend.executor(checked)
    return ex.sbatch_text(), backend.node_script(checked)


def test_golden_sbatch_script(golden, no_contact) -> None:
    sbatch, node = _sbatch_and_node(representative_config(), representative_spec())
    golden("sbatch_2nodes_torchrun.sh", sbatch)
    golden("node_2nodes_torchrun.sh", node)


def test_golden_dry_run_text_over_ssh(golden, no_contact) -> None:
    text = open_backend(representative_config(ssh_host="sunk-login")).render(representative_spec())
    golden("slurm_dry_run_2nodes_torchrun.txt", text)


def test_rendered_scripts_parse_with_bash(tmp_path: Path) -> None:
    sbatch, node = _sbatch_and_node(representative_config(), representative_spec())
    for name, text in (("sbatch.sh", sbatch), ("node.sh", node)):
        path = tmp_path / name
        path.write_text(text)
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, name


def test_sbatch_has_one_task_per_node_and_the_container_flags() -> None:
    sbatch, _ = _sbatch_and_node(representative_config(), representative_spec())
    srun = next(line for line in sbatch.splitlines() if line.startswith("srun "))
    for flag in (
        "--kill-on-bad-exit=1",
        "--ntasks-per-node=1",
        "'--container-image=docker://ghcr.io#example/posttrain:1.0'",
        "--container-mounts=/mnt/shared:/mnt/shared,/mnt/data:/mnt/data",
        "--container-env=MASTER_ADDR,MASTER_PORT,POSTTRAIN_JOB_DIR,SUBMITIT_EXECUTOR",
        "--container-workdir=/mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd",
        "--no-container-mount-home",
    ):
        assert flag in srun.split(" "), flag
    assert "#SBATCH --nodes=2" in sbatch
    assert "#SBATCH --ntasks-per-node=1" in sbatch
    assert "#SBATCH --requeue" in sbatch
    assert 'mapfile -t posttrain_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in sbatch


FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'n1\\nn2\\n' ;;
  "show node") [ -n "${FAKE_NODEADDR:-}" ] || exit 1
               echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"
               echo "   NodeAddr=$FAKE_NODEADDR NodeHostName=vm Version=22.05.8" ;;
esac
"""


def _setup_env(tmp_path: Path, sbatch: str, nodeaddr: str | None) -> dict[str, str]:
    """Run the sbatch script's setup section with a fake scontrol; the variables it exports."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    setup = sbatch.split("# setup\n", 1)[1].split("\n# command", 1)[0]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "n[1-2]"}
    if nodeaddr:
        env["FAKE_NODEADDR"] = nodeaddr
    out = subprocess.run(["bash", "-c", setup + "\nenv"], env=env, capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_rendezvous_host_is_the_first_nodes_address_not_its_name(tmp_path: Path) -> None:
    """Node names need not resolve (several slurmd on one host: n1, n2); NodeAddr is how Slurm
    itself reaches the node. Without a NodeAddr answer the name is the fallback."""
    sbatch, _ = _sbatch_and_node(representative_config(), representative_spec())
    assert _setup_env(tmp_path, sbatch, "127.0.0.1")["MASTER_ADDR"] == "127.0.0.1"
    assert _setup_env(tmp_path, sbatch, "10.4.0.17")["MASTER_PORT"] == "29500"
    assert _setup_env(tmp_path, sbatch, None)["MASTER_ADDR"] == "n1"


def test_rdzv_host_overrides_the_rendezvous_address(tmp_path: Path) -> None:
    config = representative_config(rdzv_host="10.9.8.7", master_port=29611)
    sbatch, _ = _sbatch_and_node(config, representative_spec())
    assert "scontrol show node" not in sbatch
    values = _setup_env(tmp_path, sbatch, "127.0.0.1")
    assert (values["MASTER_ADDR"], values["MASTER_PORT"]) == ("10.9.8.7", "29611")
    text = SlurmBackend(config).render(representative_spec())
    assert "# rendezvous: MASTER_ADDR is 10.9.8.7 (the cluster's rdzv_host); MASTER_PORT=29611" in text
    default = SlurmBackend(representative_config()).render(representative_spec())
    assert "# rendezvous: MASTER_ADDR is the NodeAddr of the allocation's first node" in default


@pytest.mark.parametrize("bad", ["a b", "host;rm", "-oProxy", "", "x/y"])
def test_rdzv_host_must_be_a_host_or_address(bad: str) -> None:
    with pytest.raises(ValueError, match="rdzv_host"):
        representative_config(rdzv_host=bad)
    for good in ("10.0.0.1", "node-01.cluster.internal", "fd00::1", "[fd00::1]"):
        assert representative_config(rdzv_host=good).rdzv_host == good


def test_no_container_flags_without_image() -> None:
    sbatch, _ = _sbatch_and_node(representative_config(image=None), representative_spec())
    assert "--container" not in sbatch


def test_env_wins_over_env_file_and_secrets_stay_out_of_the_render(tmp_path: Path) -> None:
    env_file = tmp_path / "train.env"
    env_file.write_text("HF_TOKEN=hf_supersecret\nNCCL_DEBUG=INFO\n")
    config = representative_config(shared_dir=str(tmp_path), mounts=[], env_file=str(env_file), setup_commands=[])
    spec = representative_spec(output_dir=None)
    backend = SlurmBackend(config)
    assert "hf_supersecret" not in backend.render(spec)
    node = tmp_path / NODE_FILE
    node.write_text(backend.node_script(backend.check(spec)))
    # the secrets file submission writes into the job folder (values with quotes and spaces)
    job_dir = Path(backend.job_dir(spec))
    job_dir.mkdir(parents=True)
    secrets = {"GITHUB_PAT": "ghp planted 'q'", "DB_PASS": "db$planted"}
    (job_dir / job_secrets.SECRETS_FILE).write_text(job_secrets.shell_file(secrets))
    env = {"PATH": "/usr/bin:/bin", "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "POSTTRAIN_JOB_DIR": "/d"}
    out = subprocess.run(["bash", str(node), "env"], env=env, capture_output=True, text=True, check=True).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert values["NCCL_DEBUG"] == "WARN"  # env wins over env_file
    assert values["HF_TOKEN"] == "hf_supersecret"  # env_file reaches the job
    assert values["RUN_LABEL"] == "nightly"
    assert values["GITHUB_PAT"] == secrets["GITHUB_PAT"] and values["DB_PASS"] == secrets["DB_PASS"]
    # an env_file that tries to move the rendezvous aborts the job
    env_file.write_text("MASTER_ADDR=evil\n")
    assert subprocess.run(["bash", str(node), "true"], env=env, capture_output=True).returncode != 0


def test_dry_run_submit_prints_the_render_and_contacts_nothing(capsys, no_contact) -> None:
    backend = open_backend(representative_config(dry_run=True, ssh_host="sunk-login"))
    handle = backend.submit(representative_spec())
    printed = capsys.readouterr().out
    assert printed == backend.render(representative_spec())
    assert handle.state() == JobState.DRY_RUN and handle.done()
    assert "#!/bin/bash" in printed and "srun --unbuffered" in printed
    assert "ssh -o BatchMode=yes -- sunk-login 'sbatch --parsable " in printed


def test_callable_job_renders_without_a_launcher_line(no_contact) -> None:
    from posttrain.cluster.smoke import CountingJob

    spec = JobSpec(name="count", run_id="r1", function=CountingJob(), args=(3, f"{SHARED}/state.json"))
    text = open_backend(representative_config()).render(spec)
    assert "python callable, once per node: posttrain.cluster.smoke.CountingJob" in text


@pytest.mark.parametrize(
    ("launcher", "args", "expected"),
    [
        (
            "torchrun",
            ["--log-dir=/tmp/logs"],
            'torchrun --nnodes=2 --nproc_per_node=8 --node_rank="$SLURM_NODEID" --master_addr="$MASTER_ADDR" '
            '--master_port="$MASTER_PORT" --log-dir=/tmp/logs -m posttrain.trainer cfg.yaml',
        ),
        (
            "accelerate",
            [],
            'accelerate launch --num_machines=2 --num_processes=16 --machine_rank="$SLURM_NODEID" '
            '--main_process_ip="$MASTER_ADDR" --main_process_port="$MASTER_PORT" --multi_gpu -m posttrain.trainer cfg.yaml',
        ),
        (
            "accelerate",
            ["--config_file=/mnt/shared/fsdp.yaml"],
            'accelerate launch --num_machines=2 --num_processes=16 --machine_rank="$SLURM_NODEID" '
            '--main_process_ip="$MASTER_ADDR" --main_process_port="$MASTER_PORT" --config_file=/mnt/shared/fsdp.yaml '
            "-m posttrain.trainer cfg.yaml",
        ),
    ],
)
def test_launcher_lines(launcher: str, args: list[str], expected: str) -> None:
    topo = Topology(2, 8, node_rank="$SLURM_NODEID")
    assert launch_line(launcher, args, ["python", "-m", "posttrain.trainer", "cfg.yaml"], topo) == expected


def test_python_launcher_runs_the_command_as_is() -> None:
    topo = Topology(1, 1, node_rank="0")
    assert launch_line("python", [], ["./train", "a b"], topo) == "./train 'a b'"
    assert launch_line("torchrun", [], ["/opt/venv/bin/python3", "train.py"], topo).endswith(" train.py")


def test_ssh_command_line() -> None:
    shell = SshShell("sunk-login")
    assert shell.argv(["sbatch", "--parsable", "/mnt/shared/a b/sbatch.sh"]) == [
        "ssh", "-o", "BatchMode=yes", "--", "sunk-login", "sbatch --parsable '/mnt/shared/a b/sbatch.sh'",
    ]  # fmt: skip
    assert LocalShell().argv(["squeue", "-j", "1"]) == ["squeue", "-j", "1"]
    assert isinstance(SlurmBackend(representative_config(ssh_host="sunk-login")).shell, SshShell)


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("PENDING", JobState.PENDING), ("REQUEUED", JobState.PENDING), ("RUNNING", JobState.RUNNING),
        ("COMPLETED", JobState.COMPLETED), ("CANCELLED by 0", JobState.CANCELLED), ("TIMEOUT", JobState.TIMEOUT),
        ("OUT_OF_MEMORY", JobState.FAILED), ("NODE_FAIL", JobState.FAILED), ("", JobState.PENDING),
    ],
)  # fmt: skip
def test_slurm_state_mapping(raw: str, state: JobState) -> None:
    assert slurm_state(raw) == state


class ScriptedShell(LocalShell):
    """Answers sbatch/squeue from a script and records the commands."""

    def __init__(self, answers: dict[str, list[tuple[int, str, str]]]) -> None:
        self.answers = answers
        self.commands: list[list[str]] = []

    def run(self, cmd, *, input=None, check=True, timeout=120):  # type: ignore[override]
        self.commands.append(list(cmd))
        code, out, err = self.answers[cmd[0]].pop(0)
        return subprocess.CompletedProcess(cmd, code, out.encode(), err.encode())


@pytest.fixture
def no_sleep(monkeypatch):
    import posttrain.cluster.slurm as slurm

    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)


def test_sbatch_retried_after_a_transient_error(no_sleep) -> None:
    shell = ScriptedShell(
        {"sbatch": [(1, "", "sbatch: error: Socket timed out on send/recv operation"), (0, "42\n", "")],
         "squeue": [(0, "7|other\n", "")]}
    )  # fmt: skip
    assert SlurmBackend(representative_config(), shell=shell)._sbatch("/x/sbatch.sh", "posttrain:a-b") == "42"
    assert [c[0] for c in shell.commands] == ["sbatch", "squeue", "sbatch"]


def test_sbatch_not_resubmitted_when_the_job_exists(no_sleep) -> None:
    shell = ScriptedShell(
        {"sbatch": [(1, "", "sbatch: error: Socket timed out on send/recv operation")],
         "squeue": [(0, "7|other\n43|posttrain:a-b\n", "")]}
    )  # fmt: skip
    assert SlurmBackend(representative_config(), shell=shell)._sbatch("/x/sbatch.sh", "posttrain:a-b") == "43"
    assert [c[0] for c in shell.commands] == ["sbatch", "squeue"]


def test_sbatch_refusal_is_not_retried(no_sleep) -> None:
    shell = ScriptedShell(
        {"sbatch": [(1, "", "sbatch: error: Invalid partition name specified")], "squeue": [(0, "", "")]}
    )
    with pytest.raises(SubmissionError, match="Invalid partition"):
        SlurmBackend(representative_config(), shell=shell)._sbatch("/x/sbatch.sh", "posttrain:a-b")
    assert [c[0] for c in shell.commands] == ["sbatch", "squeue"]


def test_submit_stages_the_job_folder_then_names_the_pickle_after_the_job_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GITHUB_PAT", "ghp-planted-value")
    monkeypatch.setenv("DB_PASS", "db-planted-value")
    shell = ScriptedShell({"sbatch": [(0, "77;cluster\n", "")]})  # stages and renames files for real
    backend = SlurmBackend(representative_config(shared_dir=str(tmp_path), env_file=None, mounts=[]), shell=shell)
    spec = representative_spec(output_dir=f"{tmp_path}/out")
    handle = backend.submit(spec)
    job_dir = Path(backend.job_dir(spec))
    assert handle.job_id == "77" and handle.job_dir == str(job_dir)
    assert sorted(p.name for p in job_dir.iterdir()) == [
        "77_submitted.pkl", NODE_FILE, "sbatch.sh", job_secrets.SECRETS_FILE, "trainer.yaml"
    ]  # fmt: skip
    # the secrets file: written before sbatch ran, readable by its owner only; no other file has a value
    secrets_file = job_dir / job_secrets.SECRETS_FILE
    assert secrets_file.stat().st_mode & 0o777 == 0o600 and job_dir.stat().st_mode & 0o077 == 0
    assert "GITHUB_PAT=ghp-planted-value" in secrets_file.read_text()
    for path in job_dir.iterdir():
        if path != secrets_file:
            assert b"planted" not in path.read_bytes(), path
    assert "source " + str(secrets_file) in (job_dir / NODE_FILE).read_text()
    assert shell.commands == [["sbatch", "--parsable", f"{job_dir}/sbatch.sh"]]
    assert "#SBATCH --comment=posttrain:grpo-nightly-20250101-000000-abcd" in (job_dir / "sbatch.sh").read_text()
    assert (job_dir / "trainer.yaml").read_text() == spec.files["trainer.yaml"]
    delayed = pickle.loads((job_dir / "77_submitted.pkl").read_bytes())
    assert delayed.function.line == backend.node_command(backend.check(spec))
    assert handle.log_path == f"{job_dir}/77_0_log.out"
    assert backend.attach("77", str(job_dir)).log_path_of(1) == f"{job_dir}/77_1_log.out"
