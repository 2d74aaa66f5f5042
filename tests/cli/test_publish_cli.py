"""``posttrain publish``, ``watch`` and ``chain apply`` as a user runs them: each refusal is one line
on stderr naming what is at fault, exit status 2, and nothing is skipped silently."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from posttrain.publish import PublishConfig, Publisher
from posttrain.publish.ledger import published_steps
from posttrain.storage import LocalStore
from tests.support.tensors import perturb, random_tensor, save_torch_checkpoint


def posttrain(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


def one_error(proc: subprocess.CompletedProcess) -> str:
    """The single line a refused command prints (no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: "), proc.stderr
    return lines[0].removeprefix("posttrain: error: ")


def _run(root: Path, seed: int, steps: int = 4) -> list[Path]:
    rng = np.random.default_rng(seed)
    state = {f"w.{i}": random_tensor(rng, "BF16", (64, 32)) for i in range(3)}
    out = []
    for step in range(1, steps + 1):
        state = {n: perturb(rng, t, 0.05) for n, t in state.items()}
        out.append(save_torch_checkpoint(root / f"checkpoint-{step}", state))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return _run(root / "main", 1), _run(root / "alt", 2)


def publish(tmp_path: Path, *args, work: str = "work", run: str = "r") -> subprocess.CompletedProcess:
    return posttrain("publish", *args, "--store", tmp_path / "store", "--run", run, "--work-dir", tmp_path / work)


def test_other_weights_for_a_published_step_are_refused_the_same_are_reported(runs, tmp_path):
    main, alt = runs
    assert publish(tmp_path, *main).returncode == 0
    line = one_error(publish(tmp_path, alt[2]))
    assert line.startswith(f"{alt[2]}: step 3 of run r is already published as step-00000003-")
    assert line.endswith("with different weights; nothing was published")
    again = publish(tmp_path, main[2])
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"already published: {main[2]} (step 3) as step-00000003-")


def test_folders_without_a_step_are_refused_unless_given_one(runs, tmp_path):
    main, _ = runs
    a, b = shutil.copytree(main[0], tmp_path / "runA"), shutil.copytree(main[1], tmp_path / "runB")
    assert one_error(publish(tmp_path, a, b)) == (f"{a}: no step in the folder's name (checkpoint-<N>) and no "
                                                  "trainer_state.json; give the step (--step)")
    assert one_error(publish(tmp_path, a, b, "--step", "1")) == "--step names the step of one checkpoint, not of 2"
    assert publish(tmp_path, a, "--step", "1").returncode == 0
    (b / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    assert publish(tmp_path, b).returncode == 0
    assert one_error(publish(tmp_path, main[2], main[2])) == f"{main[2]} and {main[2]} are both step 3"
    assert sorted(published_steps(LocalStore(tmp_path / "store"), "r")) == [1, 2]


def test_a_lost_work_dir_and_another_policy_is_refused(runs, tmp_path):
    main, _ = runs
    assert publish(tmp_path, *main).returncode == 0
    line = one_error(publish(tmp_path, *main, "--max-deltas", "2", work="wd2"))
    assert line == ("run r is published with flavor coreweave, max_deltas 128, delta_budget 1; this publisher has "
                    "flavor coreweave, max_deltas 2, delta_budget 1 (a run keeps one chain policy: use a new run name)")
    same = publish(tmp_path, *main, work="wd3")
    assert same.returncode == 0 and same.stdout.count("already published:") == 4
    assert {s: len(i) for s, i in published_steps(LocalStore(tmp_path / "store"), "r").items()} == {
        1: 1, 2: 1, 3: 1, 4: 1}


def test_a_second_publisher_on_the_work_dir_fails_fast(runs, tmp_path):
    main, _ = runs
    with Publisher(LocalStore(tmp_path / "store"), PublishConfig(run="r", work_dir=tmp_path / "work")):
        line = one_error(publish(tmp_path, main[0]))
    assert line == f"work dir {tmp_path / 'work'} is in use by another publisher (pid {os.getpid()})"
    assert publish(tmp_path, main[0]).returncode == 0


@pytest.mark.parametrize(("case", "expected"), [
    ("missing checkpoint", "checkpoint {tmp}/nope/checkpoint-1 does not exist"),
    ("work dir is a file", "work_dir (--work-dir) {tmp}/afile: is a file, not a folder"),
    ("work dir under a file", "work_dir (--work-dir) {tmp}/afile/sub/work: {tmp}/afile is a file, not a folder"),
    ("store is a file", "store {tmp}/afile: is not a folder"),
    ("empty run", "--run: String should have at least 1 character"),
    ("run with a slash", "--run: run name 'a/ledger' must be 1-128 letters, digits, '_', '.' or '-', starting "
                         "with a letter or digit (one path segment)"),
    ("too many deltas", "--max-deltas: Input should be less than or equal to 128"),
    ("run with a final newline", "--run: run name 'rn\\n' must be 1-128 letters, digits, '_', '.' or '-', "
                                 "starting with a letter or digit (one path segment)"),
])
def test_bad_input_is_one_line(runs, tmp_path, case, expected):
    main, _ = runs
    (tmp_path / "afile").touch()
    args = {"ckpt": main[0], "--store": tmp_path / "store", "--run": "r", "--work-dir": tmp_path / "work"}
    extra: list = []
    if case == "missing checkpoint":
        args["ckpt"] = tmp_path / "nope" / "checkpoint-1"
    elif case == "work dir is a file":
        args["--work-dir"] = tmp_path / "afile"
    elif case == "work dir under a file":
        args["--work-dir"] = tmp_path / "afile" / "sub" / "work"
    elif case == "store is a file":
        args["--store"] = tmp_path / "afile"
    elif case == "empty run":
        args["--run"] = ""
    elif case == "run with a slash":
        args["--run"] = "a/ledger"
    elif case == "run with a final newline":
        args["--run"] = "rn\n"
    else:
        extra = ["--max-deltas", "100000"]
    ckpt = args.pop("ckpt")
    proc = posttrain("publish", ckpt, *[x for kv in args.items() for x in kv], *extra)
    assert one_error(proc) == expected.format(tmp=tmp_path)
    assert not (tmp_path / "store" / ".posttrain").exists()  # refused before anything was written


def test_a_full_disk_is_one_line_naming_the_file(runs, tmp_path):
    """``write`` fails with ENOSPC (as on a full tmpfs) inside the store: one line naming the key's file."""
    main, _ = runs
    sitecustomize = tmp_path / "site" / "sitecustomize.py"
    sitecustomize.parent.mkdir()
    sitecustomize.write_text(
        "import errno, os, shutil\n"
        "def _full(src, dst, *a, **k):\n"
        "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
        "shutil.copyfile = _full\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sitecustomize.parent), os.environ.get("PYTHONPATH", "")])}
    for sync in ([], ["--sync"]):
        proc = posttrain("publish", main[0], "--store", tmp_path / "store", "--run", "r", "--work-dir",
                         tmp_path / "work", *sync, env=env)
        line = one_error(proc)
        assert line.startswith(f"{'' if sync else 'publishing failed: '}{tmp_path / 'store'}/step-00000001-")
        assert line.endswith(".safetensors: No space left on device")


def test_an_empty_watch_cursor_is_one_line(tmp_path):
    cursor = tmp_path / "cursor.json"
    cursor.touch()
    assert one_error(posttrain("watch", tmp_path, "--once", "--cursor", cursor)) == (
        f"{cursor}: the watch cursor file is empty (remove it to start from the first checkpoint)")
    cursor.write_text("{}")
    assert one_error(posttrain("watch", tmp_path, "--once", "--cursor", cursor)) == (
        f"{cursor}: not a valid watch cursor: output_dir: Field required (and 1 more)")


def test_chain_apply_of_a_version_missing_from_an_s3_store(moto_bucket, tmp_path):
    endpoint, bucket = moto_bucket
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    proc = posttrain("chain", "apply", f"s3://{bucket}/none", "--version", "step-00000003-abc", "--out",
                     tmp_path / "out", "--endpoint-url", endpoint, "--cache", tmp_path / "cache", env=env)
    line = one_error(proc)
    assert line.startswith(f"snapshot step-00000003-abc is not in the store (s3://{bucket}/none")


def test_chain_inspect_of_a_store_names_each_snapshots_run(runs, tmp_path):
    """Runs share a store's folder: ``chain inspect <store>`` lists every run's snapshots, each with
    its run (from the runs' ledgers), a run's together in step order. (A chain folder no run published
    to has no run column: tests/chain/test_cli.py reads its columns.)"""
    main, alt = runs
    assert publish(tmp_path, *main[:2], run="night-a").returncode == 0
    assert publish(tmp_path, *alt[:3], run="night-b", work="work-b").returncode == 0
    proc = posttrain("chain", "inspect", tmp_path / "store", env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [c.strip() for c in next(line for line in lines if "snapshot" in line).split("┃")[1:3]] == ["run",
                                                                                                       "snapshot"]
    rows = [[c.strip() for c in line.split("│")[1:3]] for line in lines if "step-0000000" in line]
    assert [run for run, _ in rows] == ["night-a"] * 2 + ["night-b"] * 3, proc.stdout
    assert [int(s.split("-")[1]) for _, s in rows] == [1, 2, 1, 2, 3]
