"""A job's credentials: plain env refuses them, ``secrets:`` hands them over without writing or
showing them. Every capture below is grepped for the planted values, with a control that it
captured something (the secret's name, or a marker)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from posttrain.cli import main
from posttrain.cluster import ConfigError, JobSpec, KubernetesConfig, LocalConfig, SlurmConfig, open_backend
from posttrain.cluster.checks import secret_name
from posttrain.cluster.shell import LocalShell

PLANTED = {"DB_PASS": "planted-db-pw-7f3a", "GITHUB_PAT": "planted-ghp-91c2"}
BASE: dict[str, dict[str, Any]] = {
    "slurm": {"shared_dir": "/mnt/shared", "image": "ghcr.io/example/posttrain:1.0"},
    "k8s": {"namespace": "ml", "image": "ghcr.io/example/posttrain:1.0", "pvc": "shared-vast"},
    "local": {},
}
TYPES = {"slurm": SlurmConfig, "k8s": KubernetesConfig, "local": LocalConfig}


def assert_clean(text: str) -> None:
    for value in PLANTED.values():
        assert value not in text


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    return PLANTED


# ---------------------------------------------------------------- plain env refuses credentials

REFUSED = ["DB_PASS", "GITHUB_PAT", "GH_AUTH", "SSH_PRIVATEKEY", "API_CREDENTIAL", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY",
           "WANDB_API_KEY", "db_password", "MY_APIKEY", "OAUTH_TOKENS",
           # a secret word glued to another word, or one of the short forms
           "PGPASSWORD", "MYSQL_PWD", "GITHUBTOKEN", "REDISPASSWD", "VAULT_ROOTPWD", "APPSECRET", "STRIPEAPIKEY",
           "GCP_CREDENTIALS", "pgpassword",
           # a connection string carries its credential inside
           "AZURE_STORAGE_CONNECTION_STRING", "DB_CONNSTR", "SERVICEBUS_CONNECTIONSTRING", "AZURE_STORAGE_ACCOUNTKEY"]  # fmt: skip
ALLOWED = ["PATH_PREFIX", "KEYBOARD_LAYOUT", "TOKENIZERS_PARALLELISM", "GIT_AUTHOR_NAME", "NCCL_DEBUG", "PATCH_LEVEL",
           "PASSTHROUGH_MODE", "MONKEY_PATCH", "HF_HOME", "COMPASS_DIR",
           "PATH", "PYTHONPATH", "HF_HUB_OFFLINE", "PWD", "OLDPWD", "PYTHON_COMPAT", "HOTKEY_MAP", "BYPASS_CACHE",
           "TOKENIZER_NAME", "CONNECTION_TIMEOUT", "MAX_CONNECTIONS_STRICT"]  # fmt: skip


@pytest.mark.parametrize("name", REFUSED)
def test_credential_names_are_recognised(name: str) -> None:
    assert secret_name(name)


@pytest.mark.parametrize("name", ALLOWED)
def test_ordinary_names_are_not(name: str) -> None:
    assert not secret_name(name)


@pytest.mark.parametrize("backend", sorted(BASE))
@pytest.mark.parametrize(
    ("name", "value", "why"),
    [("DB_PASS", PLANTED["DB_PASS"], "its name says"), ("GITHUB_PAT", PLANTED["GITHUB_PAT"], "its name says"),
     ("DATABASE_URL", f"postgres://u:{PLANTED['DB_PASS']}@db:5432/x", "URL with a user or password")],
)  # fmt: skip
def test_plain_env_refuses_credentials_and_points_to_secrets(backend: str, name: str, value: str, why: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        TYPES[backend](**BASE[backend], env={name: value})
    text = str(err.value)
    assert name in text and why in text and "secrets" in text  # the message names the variable and the fix
    assert_clean(text)


@pytest.mark.parametrize("backend", sorted(BASE))
def test_job_env_refuses_credentials_too(backend: str) -> None:
    spec = JobSpec(name="j", run_id="r1", command=["python", "x.py"], env={"GH_AUTH": PLANTED["GITHUB_PAT"]})
    with pytest.raises(ConfigError) as err:
        open_backend(TYPES[backend](**BASE[backend], dry_run=True)).render(spec)
    assert err.value.field == "job.env" and "GH_AUTH" in str(err.value)
    assert_clean(str(err.value))


@pytest.mark.parametrize("backend", sorted(BASE))
@pytest.mark.parametrize(
    ("change", "named"),
    [({"secrets": ["MASTER_ADDR"]}, "secrets"), ({"secrets": ["DB_PASS", "DB_PASS"]}, "more than once"),
     ({"secrets": ["bad-name"]}, "not a valid environment variable name"),
     ({"secrets": ["RUN_LABEL"], "env": {"RUN_LABEL": "x"}}, "also listed in secrets")],
)  # fmt: skip
def test_secrets_names_are_checked(backend: str, change: dict, named: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=named):
        TYPES[backend](**BASE[backend], **change)


def test_k8s_secrets_and_secret_env_do_not_overlap() -> None:
    with pytest.raises(pydantic.ValidationError, match="also set in secret_env"):
        KubernetesConfig(**BASE["k8s"], secrets=["HF_TOKEN"], secret_env={"HF_TOKEN": "hf/token"})


# ---------------------------------------------------------------- dry runs show names, never values


def _submit_file(tmp_path: Path, backend: str, **cluster: Any) -> str:
    job = {"name": "grpo", "command": ["python", "-m", "posttrain.trainer", "{job_dir}/trainer.yaml"]}
    if backend == "local":
        cluster.setdefault("folder", str(tmp_path / "jobs"))
    path = tmp_path / "submit.yaml"
    path.write_text(yaml.safe_dump({"backend": backend, "cluster": {**BASE[backend], **cluster}, "job": job}))
    return str(path)


@pytest.mark.parametrize("backend", sorted(BASE))
def test_dry_run_shows_the_names_never_the_values(tmp_path, capsys, no_contact, planted, backend: str) -> None:
    assert main(["submit", _submit_file(tmp_path, backend, secrets=sorted(planted)), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "DB_PASS" in out and "GITHUB_PAT" in out  # the capture worked: the names are shown
    assert_clean(out + err)
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("backend", sorted(BASE))
@pytest.mark.parametrize(("name", "value"), [
    ("DATABASE_URL", f"postgres://u:{PLANTED['DB_PASS']}@db/x"),
    ("DATABASE_URL", f"postgresql://app:{PLANTED['DB_PASS']}/x@db/x"),  # a "/" in the password
    ("SERVICE_URL", f"https://u:{PLANTED['DB_PASS']}#x@host/x"),  # a "#"
    ("PGPASSWORD", PLANTED["DB_PASS"]), ("MYSQL_PWD", PLANTED["DB_PASS"]), ("GITHUBTOKEN", PLANTED["GITHUB_PAT"]),
    # a connection string: named as one, or under an ordinary name with a credential key in its value
    ("AZURE_STORAGE_CONNECTION_STRING",
     f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={PLANTED['DB_PASS']};EndpointSuffix=x.net"),
    ("STORAGE_SETTINGS", f"BlobEndpoint=https://acct.blob.x.net;SharedAccessSignature=sv=1&sig={PLANTED['DB_PASS']}"),
    ("SQL_SERVER", f"Server=db;User Id=sa;Password={PLANTED['DB_PASS']};"),
    ("BLOB_URL", f"https://acct.blob.x.net/c?sv=2022-11-02&sig={PLANTED['DB_PASS']}"),  # a SAS URL
])  # fmt: skip
def test_a_credential_in_env_is_refused_without_echoing_it(tmp_path, capsys, no_contact, backend: str, name: str,
                                                           value: str) -> None:
    path = _submit_file(tmp_path, backend, env={name: value})
    assert main(["submit", path, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "cluster.env" in err and name in err and "secrets" in err
    assert_clean(out + err)


# ---------------------------------------------------------------- submission


class NoShell(LocalShell):
    def run(self, cmd, **kwargs):  # type: ignore[override]
        raise AssertionError(f"ran {cmd}")

    def stage(self, folder, files):  # type: ignore[override]
        raise AssertionError(f"staged {folder}")


@pytest.mark.parametrize("backend", sorted(BASE))
def test_a_missing_secret_stops_submission_naming_it(tmp_path, monkeypatch, fake_kube, backend: str) -> None:
    from posttrain.cluster.k8s import KubernetesBackend
    from posttrain.cluster.slurm import SlurmBackend

    monkeypatch.setenv("DB_PASS", PLANTED["DB_PASS"])
    monkeypatch.delenv("GITHUB_PAT", raising=False)
    extra = {"folder": str(tmp_path / "jobs")} if backend == "local" else {}
    config = TYPES[backend](**BASE[backend], **extra, secrets=["DB_PASS", "GITHUB_PAT"])
    if backend == "slurm":
        b: Any = SlurmBackend(config, shell=NoShell())
    elif backend == "k8s":
        b = KubernetesBackend(config, apis=(fake_kube.batch, fake_kube.core))
    else:
        b = open_backend(config)
    spec = JobSpec(name="grpo", run_id="r1", command=["python", "x.py"])
    with pytest.raises(ConfigError) as err:
        b.submit(spec)
    assert err.value.field == "cluster.secrets" and "GITHUB_PAT" in str(err.value)
    assert "DB_PASS" not in str(err.value)  # only the missing one is named
    assert_clean(str(err.value))
    assert fake_kube.calls == [] and not (tmp_path / "jobs").exists()


def test_a_local_job_gets_its_secrets_and_nothing_writes_them(tmp_path, capsys, planted) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import hashlib, os\n"
        "for n in ('DB_PASS', 'GITHUB_PAT'):\n"
        "    print(n, hashlib.sha256(os.environ[n].encode()).hexdigest(), flush=True)\n"
    )
    path = _submit_file(tmp_path, "local", secrets=sorted(planted), env={"RUN_LABEL": "nightly"},
                        poll_interval_s=0.2)
    doc = yaml.safe_load(Path(path).read_text())
    doc["job"]["command"] = [sys.executable, str(script)]
    Path(path).write_text(yaml.safe_dump(doc))
    assert main(["submit", path]) == 0
    out, err = capsys.readouterr()
    for name, value in planted.items():  # the job saw the values (their digests are in its log)
        assert f"{name} {hashlib.sha256(value.encode()).hexdigest()}" in out
    assert "ended COMPLETED" in err
    assert_clean(out + err)
    job_files = [p for p in (tmp_path / "jobs").rglob("*") if p.is_file()]
    assert job_files and any(p.name.endswith("_log.out") for p in job_files)
    for p in job_files:
        assert_clean(p.read_bytes().decode(errors="replace"))


def test_training_settings_errors_do_not_echo_env_values() -> None:
    from posttrain.runs.job import TrainingSettings

    with pytest.raises(pydantic.ValidationError) as err:
        TrainingSettings.model_validate({"cluster": {"backend": "local", "env": {"DB_PASS": PLANTED["DB_PASS"]}},
                                         "trainer": {}})
    assert "DB_PASS" in str(err.value)
    assert_clean(str(err.value))
