"""``posttrain gc`` as a user runs it: the table, the exit status, one line per bad input, and
nothing deleted by a dry run or by bad input."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from posttrain.publish.lease import publishing
from posttrain.publish.ledger import Ledger
from posttrain.storage import LocalStore
from posttrain.storage.prefixed import PrefixedStore
from tests.support.chains import publish_runs, snapshots_in
from tests.support.s3 import free_port


def posttrain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def three_runs(tmp_path):
    store = LocalStore(tmp_path / "store")
    return store, publish_runs(store, tmp_path / "runs", runs=3, steps=3)


def files(store: LocalStore) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(store.root.rglob("*")) if p.is_file()
            and ".posttrain-store" not in p.parts}


def test_dry_run_prints_the_table_and_deletes_nothing(three_runs):
    store, done = three_runs
    before = files(store)
    proc = posttrain("gc", "--store", str(store.root), "--keep-runs", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"{store.uri}: 3 runs; kept whole: night-2, night-1" in proc.stdout
    for col in ("run", "identity", "kind", "step", "bytes"):
        assert f" {col} " in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if "night-0" in line and "step-" in line]
    assert [re.search(r"step-\S+", r).group(0) for r in rows] == done.identities("night-0")[::-1]  # newest first
    total = sum(e.stored_bytes for e in Ledger(store, "night-0").entries())
    assert proc.stdout.splitlines()[-1] == (f"dry run: 3 snapshots, {total / 1024:.1f} KiB ({total} bytes) would be "
                                            "freed; nothing was deleted")
    assert files(store) == before


def test_gc_deletes_and_reports_what_it_freed(three_runs):
    store, done = three_runs
    total = sum(e.stored_bytes for e in Ledger(store, "night-0").entries())
    proc = posttrain("gc", "--store", store.uri, "--keep-runs", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"deleted 3 snapshots, freed {total / 1024:.1f} KiB ({total} bytes)"
    assert snapshots_in(store) == set(done.identities("night-1")) | set(done.identities("night-2"))
    again = posttrain("gc", "--store", store.uri, "--keep-runs", "2")
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == "nothing to delete"


def test_one_run_and_one_snapshot_are_said_in_the_singular(tmp_path):
    store = LocalStore(tmp_path / "store")
    done = publish_runs(store, tmp_path / "runs", runs=2, steps=1)
    proc = posttrain("gc", "--store", store.uri, "--keep-runs", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("deleted 1 snapshot, freed "), proc.stdout  # not "1 snapshots"
    assert snapshots_in(store) == set(done.identities("night-1"))


def test_a_run_being_published_is_skipped_and_named(three_runs, tmp_path):
    store, done = three_runs
    with publishing(store, "night-0", tmp_path / "work"):
        proc = posttrain("gc", "--store", str(store.root), "--keep-runs", "2")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^skipped run night-0: being published \(publisher pid \d+ on .+, lease expires in \d+s\)$",
                     proc.stdout, re.M), proc.stdout
    assert proc.stdout.splitlines()[-1] == "deleted 0 snapshots, freed 0 B (0 bytes)"
    assert set(done.identities("night-0")) <= snapshots_in(store)


def test_protect_file_and_prefix(tmp_path):
    base = LocalStore(tmp_path / "store")
    done = publish_runs(PrefixedStore(base, "deploy"), tmp_path / "runs", runs=2, steps=3)
    steps = done.identities("night-0")
    (tmp_path / "served.txt").write_text(f"# what the deployments serve\n{steps[1]}  # deployment a\n\n")
    proc = posttrain("gc", "--store", str(base.root), "--prefix", "deploy", "--keep-runs", "1",
                     "--protect-file", str(tmp_path / "served.txt"))
    assert proc.returncode == 0, proc.stderr
    assert snapshots_in(PrefixedStore(base, "deploy")) == set(done.identities("night-1")) | set(steps[:2])


BAD = [
    (["--keep-runs", "0"], "--keep-runs: Input should be greater than or equal to 1"),
    (["--keep-runs", "-1"], "--keep-runs: Input should be greater than or equal to 1"),
    (["--keep-days", "0"], "--keep-days: Input should be greater than 0"),
    (["--keep-runs", "1", "--keep-days", "2"], "give --keep-runs N or --keep-days D (exactly one)"),
    ([], "give --keep-runs N or --keep-days D (exactly one)"),
    (["--keep-runs", "1", "--protect", "step-00000002-typo"],
     "protected identity 'step-00000002-typo' is not a snapshot in {uri} (no run's ledger has it and it has no "
     "index): a typo? nothing was deleted"),
    (["--keep-runs", "1", "--protect-file", "{tmp}/missing.txt"], "--protect-file {tmp}/missing.txt: No such file "
     "or directory"),
]


@pytest.mark.parametrize(("args", "line"), BAD, ids=["zero", "negative", "zero-days", "both", "neither", "typo",
                                                     "protect-file"])
def test_bad_input_is_one_line_and_deletes_nothing(three_runs, tmp_path, args, line):
    store, _ = three_runs
    before = files(store)
    args = [a.format(tmp=tmp_path) for a in args]
    proc = posttrain("gc", "--store", str(store.root), *args)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"posttrain: error: {line.format(uri=store.uri, tmp=tmp_path)}"]
    assert files(store) == before


def test_an_unreachable_store_is_one_line(tmp_path):
    proc = posttrain("gc", "--store", str(tmp_path / "nope"), "--keep-runs", "1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"posttrain: error: --store {tmp_path / 'nope'}: no such folder"]
    assert not (tmp_path / "nope").exists()  # gc creates no store
    proc = posttrain("gc", "--store", "s3://bucket/prefix", "--endpoint-url", f"http://127.0.0.1:{free_port()}",
                     "--outage-retry", "0", "--keep-runs", "1",
                     env={"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"})
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("posttrain: error: list s3://bucket/prefix/.posttrain/runs/ at http://127.0.0.1:")
    assert "Could not connect" in proc.stderr
