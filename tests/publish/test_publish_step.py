"""Publisher.publish_step: one snapshot per step whatever the number of calls; who closes the store."""

from __future__ import annotations

import pytest

from posttrain.publish import PublishConfig, Publisher, PublishError
from posttrain.publish.ledger import Ledger
from posttrain.publish.publisher import published_steps
from posttrain.storage import LocalStore


class CountingStore(LocalStore):
    closed = 0

    def close(self) -> None:
        self.closed += 1
        super().close()


def _file_times(root) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("async_publish", [False, True])
def test_publish_step_again_returns_the_same_snapshot_and_uploads_nothing(run_checkpoints, tmp_path, async_publish):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=async_publish)
    steps = list(enumerate(run_checkpoints[:3], start=1))
    with Publisher(store, config) as publisher:
        first = [publisher.publish_step(ckpt, step) for step, ckpt in steps]
        same = publisher.publish_step(run_checkpoints[2], 3)  # the same step twice in one process
    assert [p.step for p in first] == [1, 2, 3] and first[0].kind == "full"
    assert all(p.uploaded_bytes > 0 for p in first)
    assert same.identity == first[2].identity
    files = _file_times(tmp_path / "store")

    # a retried task: a new publisher on the same work folder publishes every step again
    with Publisher(store, config) as again:
        redo = [again.publish_step(ckpt, step) for step, ckpt in steps]
    assert [p.identity for p in redo] == [p.identity for p in first]
    assert [(p.kind, p.base, p.stored_bytes) for p in redo] == [(p.kind, p.base, p.stored_bytes) for p in first]
    assert all(p.uploaded_bytes == 0 for p in redo)
    assert _file_times(tmp_path / "store") == files  # nothing written to the store
    assert {s: len(ids) for s, ids in published_steps(store, "r1").items()} == {1: 1, 2: 1, 3: 1}


def test_publish_step_raises_when_the_step_has_no_snapshot(run_checkpoints, tmp_path):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)
    with Publisher(store, config) as publisher:
        done = [publisher.publish_step(ckpt, step) for step, ckpt in enumerate(run_checkpoints[:2], start=1)]
    Ledger(store, "r1").delete(done[0].identity)  # step 1's ledger entry is lost
    with Publisher(store, config) as again, pytest.raises(PublishError, match="step 1 was not published"):
        again.publish_step(run_checkpoints[0], 1)


@pytest.mark.parametrize("owns_store", [True, False])
def test_closing_the_publisher_closes_the_store_only_when_it_owns_it(tmp_path, owns_store):
    store = CountingStore(tmp_path / "store")
    with Publisher(store, PublishConfig(run="r1", work_dir=tmp_path / "work"), owns_store=owns_store):
        assert store.closed == 0
    assert store.closed == (1 if owns_store else 0)
