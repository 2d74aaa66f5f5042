"""``posttrain gc`` and the promotion histories in the store: the dry run names what a history
keeps and why; a history record that cannot be read is one line, exit status 2, nothing deleted."""

from __future__ import annotations

from posttrain.promote.history import History
from posttrain.storage import LocalStore
from tests.cli.test_gc_cli import files, posttrain
from tests.publish.test_gc_history import record
from tests.support.chains import publish_runs, snapshots_in


def test_the_dry_run_names_what_the_history_keeps_and_gc_keeps_it(tmp_path):
    store = LocalStore(tmp_path / "store")
    done = publish_runs(store, tmp_path / "runs", runs=3, steps=3)
    champion = done.identities("night-0")[1]
    History(store, "", "prod").append(record("promotion", champion, None))
    before = files(store)
    proc = posttrain("gc", "--store", str(store.root), "--keep-runs", "1", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"protected: {champion} (history of prod)" in proc.stdout.splitlines()
    assert files(store) == before
    proc = posttrain("gc", "--store", str(store.root), "--keep-runs", "1")
    assert proc.returncode == 0, proc.stderr
    assert snapshots_in(store) == set(done.identities("night-2")) | set(done.identities("night-0")[:2])


def test_a_malformed_history_record_is_one_line_and_deletes_nothing(tmp_path):
    store = LocalStore(tmp_path / "store")
    publish_runs(store, tmp_path / "runs", runs=2, steps=2)
    key = ".posttrain/promotions/prod/00000001.json"
    store.put_bytes(key, b'{"kind": "promotion"')
    before = files(store)
    proc = posttrain("gc", "--store", str(store.root), "--keep-runs", "1")
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("posttrain: error: promotion history of deployment prod: ") and key in line
    assert line.endswith("; gc stopped, nothing was deleted")
    assert files(store) == before
