"""The ``posttrain`` command's edges, run as a user runs them: the exit status and the one line."""

from __future__ import annotations

import subprocess
import sys

import pytest


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
