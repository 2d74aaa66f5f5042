"""The ``posttrain`` command's edges, run as a user runs them: the exit status and the one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.s3 import PLANTED_KEY_ID, assert_no_planted


def posttrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "prog"),
    [(["--bogus"], "posttrain"), (["--bogus", "chain", "verify", "x"], "posttrain"),
     (["chain", "--bogus"], "posttrain chain")],
)
def test_an_unknown_option_is_named(args, prog):
    proc = posttrain(*args)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == f"{prog}: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize(("args", "missing"), [([], "posttrain: error: the following arguments are required: COMMAND"),
                                               (["chain"], "posttrain chain: error: the following arguments are "
                                                           "required: SUBCOMMAND")])
def test_a_missing_subcommand_is_still_reported(args, missing):
    proc = posttrain(*args)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == missing


def test_watch_once_on_a_missing_folder_is_an_error(tmp_path):
    missing = tmp_path / "nope"
    proc = posttrain("watch", str(missing), "--once", "--cursor", str(tmp_path / "cursor.json"))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == f"posttrain: error: {missing} does not exist"


def test_watch_ends_with_an_error_when_the_job_never_made_the_folder(tmp_path):
    missing, done = tmp_path / "nope", tmp_path / "done"
    done.touch()
    proc = posttrain("watch", str(missing), "--done-file", str(done), "--poll", "0.05",
                     "--cursor", str(tmp_path / "cursor.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"posttrain: error: {missing} does not exist"


def test_watch_of_a_file_is_an_error(tmp_path):
    a_file = tmp_path / "f"
    a_file.touch()
    proc = posttrain("watch", str(a_file), "--cursor", str(tmp_path / "cursor.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"posttrain: error: {a_file} is not a folder"


def test_watch_once_on_an_empty_folder_prints_nothing(tmp_path):
    proc = posttrain("watch", str(tmp_path), "--once", "--cursor", str(tmp_path / "cursor.json"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_an_endpoint_url_with_a_password_is_never_printed(tmp_path):
    proc = posttrain("chain", "apply", "s3://bucket/p", "--version", "v1", "--out", str(tmp_path / "out"),
                     "--cache", str(tmp_path / "cache"), "--endpoint-url", "http://planted-user:planted-pw@127.0.0.1:99999")
    assert proc.returncode == 2
    assert "http://***@127.0.0.1:99999" in proc.stderr  # the capture worked: the endpoint is named
    assert "planted" not in proc.stdout + proc.stderr


def test_s3_credentials_of_the_environment_echoed_by_the_endpoint_are_never_printed(tmp_path, echo_endpoint):
    proc = posttrain("chain", "apply", "s3://bucket/p", "--version", "v1", "--out", str(tmp_path / "out"),
                     "--cache", str(tmp_path / "cache"), "--endpoint-url", echo_endpoint.url)
    assert proc.returncode == 2
    assert "AccessDenied" in proc.stderr and "echoed request headers" in proc.stderr  # the capture worked
    assert PLANTED_KEY_ID in "".join(echo_endpoint.seen)  # and the key id was sent
    assert_no_planted(proc.stdout + proc.stderr)


@pytest.mark.parametrize("kind", ["validation", "storage", "chain", "other"])
def test_main_tells_error_kinds_apart_without_importing_their_modules_first(kind, monkeypatch, capsys):
    """``main`` imports neither pydantic nor the stores up front (a codec command needs neither), yet a
    command's ValidationError, StorageError or ChainError is still one line and exit status 2; any other
    error still raises."""
    import posttrain.cli.chain as chain_cli
    from posttrain.cli import main

    def failing(args):
        if kind == "validation":
            from pydantic import BaseModel, ConfigDict

            class Settings(BaseModel):
                model_config = ConfigDict(extra="forbid")
                workers: int

            Settings.model_validate({"workers": "many"})
        if kind == "storage":
            from posttrain.storage.errors import NotFound

            raise NotFound("s3://bucket/prefix/v1/index.json does not exist")
        if kind == "chain":
            from posttrain.chain.errors import FormatError

            raise FormatError("chain/v1: not a snapshot")
        raise RuntimeError("a bug")

    monkeypatch.setattr(chain_cli, "cmd_verify", failing)  # the parser is built at each main() call
    if kind == "other":
        with pytest.raises(RuntimeError, match="a bug"):
            main(["chain", "verify", "x"])
        return
    assert main(["chain", "verify", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    expected = {"validation": "workers", "storage": "does not exist", "chain": "not a snapshot"}[kind]
    assert len(err) == 1 and err[0].startswith("posttrain: error: ") and expected in err[0], err


def test_main_prints_a_model_level_validation_error_once_without_pydantics_prefix(monkeypatch, capsys):
    """A check of two settings together has no field location: main prints the model's name once and
    the check's message (it names the settings), not ``Settings: Settings: Value error, ...``."""
    import posttrain.cli.chain as chain_cli
    from posttrain.cli import main

    def failing(args):
        from pydantic import BaseModel, model_validator

        class Settings(BaseModel):
            low: int = 2
            high: int = 1

            @model_validator(mode="after")
            def _order(self):
                raise ValueError("low (--low) must not exceed high (--high)")

        Settings()

    monkeypatch.setattr(chain_cli, "cmd_verify", failing)
    assert main(["chain", "verify", "x"]) == 2
    assert capsys.readouterr().err == "posttrain: error: Settings: low (--low) must not exceed high (--high)\n"


def test_chain_apply_from_a_store_takes_the_s3_options_of_the_other_store_commands(tmp_path, monkeypatch):
    """--outage-retry 0: an unreachable endpoint is one line at once (by default the store keeps
    retrying for 120 s, past this helper's 60 s timeout)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "planted-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "planted-secret")
    proc = posttrain("chain", "apply", "s3://bucket/p", "--version", "v1", "--out", str(tmp_path / "out"),
                     "--cache", str(tmp_path / "cache"), "--endpoint-url", "http://127.0.0.1:1", "--region",
                     "us-east-1", "--outage-retry", "0")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "posttrain: error: get s3://bucket/p/v1/model.safetensors.index.json at http://127.0.0.1:1: "
        'EndpointConnectionError: Could not connect to the endpoint URL: "http://127.0.0.1:1/bucket/p/v1/'
        'model.safetensors.index.json"']
    assert "planted" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("value", ["1e-300", "0", "nan", "inf"])
def test_a_busy_poll_of_watch_is_named(tmp_path, value):
    """1e-300 passed ``> 0`` and the watch then scanned the folder without pause."""
    proc = posttrain("watch", str(tmp_path), "--poll", value, "--cursor", str(tmp_path / "cursor.json"))
    assert proc.returncode == 2 and proc.stdout == ""
    want = f"posttrain: error: --poll {float(value):g}: must be at least 0.05 seconds (and finite)"
    assert proc.stderr.strip() == want


@pytest.mark.parametrize("value", [1e-300, float("nan"), float("inf")])
def test_a_busy_poll_of_rollback_is_named(value):
    """--poll-interval 1e-300 passed the CLI's ``> 0`` check, then the hot-load config refused it as --api-url's."""
    import argparse

    from posttrain.cli import UsageError
    from posttrain.cli.rollback import _config

    args = argparse.Namespace(timeout=60.0, poll_interval=value, api_url="http://127.0.0.1:1")
    with pytest.raises(UsageError, match=r"^--poll-interval .*: must be at least 0.05 seconds"):
        _config(args, "prod")


def test_main_prints_a_validation_error_that_names_no_problem_as_one_line(monkeypatch, capsys):
    """A ValidationError with an empty error list (``from_exception_data(title, [])``) is still one line
    naming the model, with exit status 2, not an IndexError out of main."""
    import posttrain.cli.chain as chain_cli
    from posttrain.cli import main

    def failing(args):
        from pydantic_core import ValidationError

        raise ValidationError.from_exception_data("Settings", [])

    monkeypatch.setattr(chain_cli, "cmd_verify", failing)
    assert main(["chain", "verify", "x"]) == 2
    assert capsys.readouterr().err == "posttrain: error: Settings: is not valid (no problem was named)\n"
