"""Checks before a job is queued (posttrain.cluster.preflight): the paths the job reads exist, and
the launcher is on the job's PATH: locally by lookup, on Slurm by an srun probe (here a fake srun
that runs the probe's script on this machine; the real one: test_cluster_preflight_slurm.py)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from posttrain.cluster import ConfigError, KubernetesConfig, LocalConfig, SlurmConfig
from posttrain.cluster import preflight


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    return {"base_model": tmp_path / "model", "dataset": tmp_path / "prompts.jsonl", "shared_dir": tmp_path / "shared"}


def _paths(inputs: dict[str, Path], **change: str) -> dict:
    kinds = {"base_model": "model folder", "dataset": "file", "shared_dir": "folder to create"}
    return {k: (change.get(k, str(v)), kinds[k]) for k, v in inputs.items()}


# the Slurm cluster's shared storage holds every path these tests use (the rule: the tests below)
CONFIGS = [LocalConfig(), SlurmConfig(shared_dir="/mnt/shared", mounts=[os.path.realpath(tempfile.gettempdir()),
                                                                        "/models", "/data", "/mnt"])]


@pytest.mark.parametrize("config", CONFIGS, ids=["local", "slurm"])
def test_present_paths_pass_and_a_shared_dir_to_create_may_be_missing(config, inputs):
    preflight.check_paths(config, _paths(inputs))


@pytest.mark.parametrize(("config", "where"), [(CONFIGS[0], "checked on this machine, where the job runs"),
                                               (CONFIGS[1], "checked on this login node, which sees the cluster's "
                                                            "shared storage")], ids=["local", "slurm"])
@pytest.mark.parametrize(("change", "message"), [
    ({"base_model": "/models/does-not-exist"}, "base_model: /models/does-not-exist does not exist"),
    ({"dataset": "/data/missing.jsonl"}, "dataset: /data/missing.jsonl does not exist"),
    ({"shared_dir": "/mnt/shraed/posttrain"}, "shared_dir: /mnt/shraed/posttrain does not exist, nor does its parent"),
])  # fmt: skip
def test_a_missing_path_is_one_line_naming_the_parameter(config, where, inputs, change, message):
    with pytest.raises(ConfigError) as info:
        preflight.check_paths(config, _paths(inputs, **change))
    assert str(info.value).startswith(message) and str(info.value).endswith(f"({where})")
    assert "\n" not in str(info.value)


def test_a_folder_given_as_the_dataset_is_named(inputs):
    with pytest.raises(ConfigError, match=r"^dataset: .* is not a file"):
        preflight.check_paths(LocalConfig(), _paths(inputs, dataset=str(inputs["base_model"])))


def test_kubernetes_paths_are_checked_in_the_pvc_this_machine_mounts(inputs, tmp_path):
    # the flow's machine mounts the job's PVC at pvc_mount, as the pods do (docs/site-setup.md)
    config = KubernetesConfig(namespace="ml", image="registry/posttrain:1", pvc="shared", pvc_mount=str(tmp_path))
    preflight.check_paths(config, _paths(inputs))
    with pytest.raises(ConfigError, match=r"^base_model: .*/nope does not exist \(checked on this machine, which "
                                          r"mounts the PVC shared at "):
        preflight.check_paths(config, _paths(inputs, base_model=str(tmp_path / "nope")))
    elsewhere = _paths(inputs, dataset="/elsewhere/prompts.jsonl")
    with pytest.raises(ConfigError, match=r"^dataset: /elsewhere/prompts.jsonl is not on the PVC \(under pvc_mount"):
        preflight.check_paths(config, elsewhere)
    with pytest.raises(ConfigError, match=r"^dataset: /elsewhere/prompts.jsonl does not exist"):
        preflight.check_paths(config, elsewhere, job_reads={"base_model", "shared_dir"})  # read here, not by pods


def test_slurm_paths_must_be_on_the_clusters_shared_storage(inputs, tmp_path):
    """The job's settings refuse a path outside shared_dir and mounts at submit (after staging,
    as a pydantic error naming trainer.model_name_or_path): checked here first, as on Kubernetes."""
    config = SlurmConfig(shared_dir=str(tmp_path / "shared"), mounts=["/opt/site"])
    with pytest.raises(ConfigError) as info:
        preflight.check_paths(config, _paths(inputs), job_reads={"base_model", "shared_dir"},
                              block="posttrain-slurm-cluster/sunk")
    assert str(info.value) == (f"base_model: {inputs['base_model']} is not on the cluster's shared storage (under "
                               f"neither shared_dir {tmp_path}/shared nor mounts [/opt/site] of block "
                               "posttrain-slurm-cluster/sunk); the nodes would not see it: move it there, or add "
                               "its folder to mounts")
    # the dataset is read by the flow, which stages it into shared_dir: it may be anywhere
    on_shared = _paths(inputs, base_model=str(tmp_path / "shared" / "model"), shared_dir=str(tmp_path / "shared" / "x"))
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "model").symlink_to(inputs["base_model"])
    with pytest.raises(ConfigError, match=rf"^base_model: {tmp_path}/shared/model resolves to {inputs['base_model']}, "
                                          r"which is not on the cluster's shared storage \(under neither shared_dir "
                                          r".* of the cluster settings\): a link points off it"):
        preflight.check_paths(config, on_shared, job_reads={"base_model", "shared_dir"})
    preflight.check_paths(config.model_copy(update={"mounts": [str(tmp_path)]}), on_shared,
                          job_reads={"base_model", "shared_dir"})


def test_slurm_links_are_resolved_on_the_login_node_through_ssh_host(inputs, tmp_path, fake_ssh, monkeypatch):
    from posttrain.cluster import shell

    ssh, log = fake_ssh
    real_ssh_shell = shell.SshShell
    monkeypatch.setattr(shell, "SshShell", lambda host: real_ssh_shell(host, ssh=ssh))
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "model").symlink_to(inputs["base_model"])
    config = SlurmConfig(shared_dir=str(tmp_path / "shared"), ssh_host="sunk-login")
    with pytest.raises(ConfigError, match=r"^base_model: .*/shared/model resolves to .*/model, which is not on"):
        preflight.check_paths(config, _paths(inputs, base_model=str(tmp_path / "shared" / "model"),
                                             shared_dir=str(tmp_path / "shared" / "x")),
                              job_reads={"base_model", "shared_dir"})
    assert any(line.startswith("sunk-login realpath -m -- ") for line in log.read_text().splitlines())


def _program(folder: Path, name: str, body: str = "exit 0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_local_launcher_found_on_the_jobs_path(tmp_path):
    _program(tmp_path / "bin", "torchrun")
    preflight.check_launcher(LocalConfig(launcher="torchrun", env={"PATH": str(tmp_path / "bin")}))


def test_local_launcher_missing_is_named_before_the_job_starts(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^launcher: torchrun is not on the job's PATH on this machine"):
        preflight.check_launcher(LocalConfig(launcher="torchrun", env={"PATH": str(tmp_path / "empty")}))
    # launcher python starts the command as written: nothing to look up
    preflight.check_launcher(LocalConfig(launcher="python", env={"PATH": str(tmp_path / "empty")}))


def test_local_launcher_put_on_the_path_by_setup_commands(tmp_path):
    _program(tmp_path / "venv" / "bin", "accelerate")
    (tmp_path / "empty").mkdir()
    config = LocalConfig(launcher="accelerate", env={"PATH": f"{tmp_path / 'empty'}:/usr/bin:/bin"},
                         setup_commands=[f"export PATH={tmp_path / 'venv' / 'bin'}:$PATH"])
    preflight.check_launcher(config)


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    """An srun that logs its arguments and runs the probe's script (its last argument) here."""
    log = tmp_path / "srun.log"
    _program(tmp_path / "fake", "srun", f'echo "${{*//$\'\\n\'/; }}" >> {log}\nexec bash -c "${{@: -1}}"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'fake'}:/usr/bin:/bin")
    monkeypatch.setattr(preflight, "_probed", {})
    return log


def test_slurm_probe_finds_the_launcher_once_per_cluster_settings(tmp_path, fake_srun):
    _program(tmp_path / "venv", "torchrun")
    config = SlurmConfig(shared_dir="/mnt/shared", partition="h100", account="ml", qos="high",
                         setup_commands=[f"export PATH={tmp_path / 'venv'}:$PATH"])
    preflight.check_launcher(config)
    preflight.check_launcher(config.model_copy(update={"poll_interval_s": 5}))  # same cluster: no second probe
    calls = fake_srun.read_text().splitlines()
    assert len(calls) == 1
    assert "--partition=h100 --account=ml --qos=high" in calls[0] and "--nodes=1 --ntasks=1 --time=1" in calls[0]


def test_slurm_probe_missing_launcher_is_one_line_naming_the_partition(tmp_path, fake_srun):
    config = SlurmConfig(shared_dir="/mnt/shared", partition="h100", env={"PATH": "/usr/bin:/bin"})
    for _ in range(2):  # cached: the second check answers without a probe
        with pytest.raises(ConfigError) as info:
            preflight.check_launcher(config)
        assert str(info.value).startswith("launcher: torchrun is not on the nodes' PATH (partition h100")
        assert "\n" not in str(info.value)
    assert len(fake_srun.read_text().splitlines()) == 1


def test_slurm_probe_that_gets_no_allocation_checks_nothing(tmp_path, monkeypatch):
    _program(tmp_path / "fake", "srun", 'echo "srun: error: Unable to allocate resources: Immediate" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{tmp_path / 'fake'}:/usr/bin:/bin")
    monkeypatch.setattr(preflight, "_probed", {})
    note = preflight.check_launcher(SlurmConfig(shared_dir="/mnt/shared"))
    assert note.startswith("launcher torchrun not checked: the srun probe failed") and "Unable to allocate" in note
    assert preflight._probed == {}  # asked again next time


def test_slurm_probe_runs_in_the_jobs_image_after_its_env():
    config = SlurmConfig(shared_dir="/mnt/shared", image="/mnt/shared/img.sqsh", env={"NCCL_DEBUG": "INFO"},
                         env_file="/mnt/shared/job.env", setup_commands=["module load cuda"])
    argv = preflight.probe_command(config, "torchrun")
    assert "--container-image=/mnt/shared/img.sqsh" in argv and "--container-mounts=/mnt/shared:/mnt/shared" in argv
    script = argv[-1].splitlines()
    assert script[:4] == ["set -a", "source /mnt/shared/job.env", "set +a", "export NCCL_DEBUG=INFO"]
    assert script[4] == "module load cuda" and script[5].startswith("command -v torchrun ||")


def test_kubernetes_launcher_is_the_images_business(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    preflight.check_launcher(KubernetesConfig(namespace="ml", image="registry/posttrain:1", pvc="shared"))


def test_the_job_environment_path_is_what_the_local_backend_uses():
    # the lookup must search the PATH the job gets: the submitter's Python folder first
    from posttrain.cluster.local import LocalBackend
    from posttrain.cluster.spec import JobSpec

    env = LocalBackend(LocalConfig()).environment(JobSpec(name="x", command=["python"]))
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(os.sys.executable)


@pytest.mark.parametrize(("config", "where"), [(CONFIGS[0], "checked on this machine, where the job runs"),
                                               (CONFIGS[1], "checked on this login node, which sees the cluster's "
                                                            "shared storage")], ids=["local", "slurm"])
def test_an_empty_model_folder_is_named_with_the_missing_file(config, where, inputs, tmp_path):
    """An empty base_model folder passed; the job then failed in from_pretrained, after a queue slot."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as info:
        preflight.check_paths(config, _paths(inputs, base_model=str(tmp_path / "empty")))
    assert str(info.value) == (f"base_model: {tmp_path / 'empty'} has no config.json: not a Hugging Face model "
                               f"folder ({where})")


def test_a_link_on_the_pvc_that_points_off_it_is_refused(inputs, tmp_path):
    """The pods resolve the link in their own file system, where the PVC holds only what is under
    pvc_mount: the model it points to is not there."""
    pvc = tmp_path / "pvc"
    (pvc / "models").mkdir(parents=True)
    config = KubernetesConfig(namespace="ml", image="registry/posttrain:1", pvc="shared", pvc_mount=str(pvc))
    (pvc / "models" / "off").symlink_to(inputs["base_model"])  # a real model folder, off the PVC
    (pvc / "models" / "base").mkdir()
    (pvc / "models" / "base" / "config.json").write_text("{}")
    (pvc / "models" / "on").symlink_to(pvc / "models" / "base")  # a link that stays on the PVC is fine
    paths = _paths(inputs, base_model=str(pvc / "models" / "on"), shared_dir=str(pvc / "posttrain"))
    preflight.check_paths(config, paths, job_reads={"base_model", "shared_dir"})
    with pytest.raises(ConfigError) as info:
        preflight.check_paths(config, {**paths, "base_model": (str(pvc / "models" / "off"), "model folder")},
                              job_reads={"base_model", "shared_dir"})
    assert str(info.value) == (f"base_model: {pvc}/models/off resolves to {inputs['base_model']}, which is not on "
                               f"the PVC (under pvc_mount {pvc}): a link points off it; the pods would not see it")
    (pvc / "work").symlink_to(tmp_path)  # a folder to create under a link off the PVC
    with pytest.raises(ConfigError, match=r"^shared_dir: .* resolves to .*, which is not on the PVC"):
        preflight.check_paths(config, {**paths, "shared_dir": (str(pvc / "work" / "posttrain"), "folder to create")},
                              job_reads={"base_model", "shared_dir"})


def test_setup_commands_are_checked_with_no_bash_on_the_jobs_path(tmp_path):
    """The job runs its line with /bin/bash by path; the check looked bash up on the job's PATH and
    raised FileNotFoundError (a traceback) when the PATH had none."""
    (tmp_path / "empty").mkdir()
    _program(tmp_path / "venv" / "bin", "torchrun")
    missing = LocalConfig(launcher="torchrun", env={"PATH": str(tmp_path / "empty")}, setup_commands=["true"])
    with pytest.raises(ConfigError, match=r"^launcher: torchrun is not on the job's PATH on this machine"):
        preflight.check_launcher(missing)
    preflight.check_launcher(LocalConfig(launcher="torchrun", env={"PATH": str(tmp_path / "empty")},
                                         setup_commands=[f"PATH={tmp_path / 'venv' / 'bin'}:$PATH"]))


def test_a_job_shell_that_cannot_run_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "JOB_SHELL", str(tmp_path / "no-bash"))
    with pytest.raises(ConfigError) as info:
        preflight.check_launcher(LocalConfig(launcher="torchrun", setup_commands=["true"]))
    assert str(info.value) == (f"setup_commands: cannot run {tmp_path / 'no-bash'}, the shell that runs them "
                               "(No such file or directory)")


def test_the_reference_model_is_checked_like_the_base_model(inputs, tmp_path):
    """ref_model_name_or_path (beta > 0) was not checked: a wrong path failed the job in round 0."""
    name = "ref_model_name_or_path"
    preflight.check_model_ref(LocalConfig(), name, str(inputs["base_model"]))
    preflight.check_model_ref(LocalConfig(), name, "Qwen/Qwen2.5-0.5B")  # a hub id: the job downloads it
    with pytest.raises(ConfigError, match=r"^ref_model_name_or_path: /models/ref does not exist \(checked on this"):
        preflight.check_model_ref(LocalConfig(), name, "/models/ref")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^ref_model_name_or_path: .*/empty has no config.json"):
        preflight.check_model_ref(LocalConfig(), name, str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"^ref_model_name_or_path: './ref' is neither an absolute path"):
        preflight.check_model_ref(LocalConfig(), name, "./ref")
    config = KubernetesConfig(namespace="ml", image="registry/posttrain:1", pvc="shared",
                              pvc_mount=str(tmp_path / "pvc"))
    with pytest.raises(ConfigError, match=r"^ref_model_name_or_path: .* is not on the PVC"):
        preflight.check_model_ref(config, name, str(inputs["base_model"]))


def test_an_address_nothing_answers_at_is_named_at_once():
    """An unreachable dask_address was found at the first round's shards, after the resident job was
    submitted (which then idled until its round timeout)."""
    import socket
    import time

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        preflight.check_reachable("dask_address", f"tcp://127.0.0.1:{listening.getsockname()[1]}")
        with socket.socket() as closed:  # a port nothing listens on
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            preflight.check_reachable("dask_address", f"tcp://127.0.0.1:{port}")
        assert time.monotonic() - t0 < preflight.CONNECT_TIMEOUT_S + 5
    assert str(info.value) == (f"dask_address: nothing answers at tcp://127.0.0.1:{port} (Connection refused, "
                               "waited at most 5 s); start the scheduler or fix the address")
    assert preflight.check_reachable("dask_address", "ucx://10.0.0.5:8786") is not None  # not TCP: not checked
