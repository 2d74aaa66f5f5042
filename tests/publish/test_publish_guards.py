"""A publish never skips silently: other weights for a published step, folders without a step,
another chain policy for a run, run names that could collide, two publishers on one work folder,
a full disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading

import numpy as np
import pytest
from pydantic import ValidationError

from posttrain.chain.ops import NoStep
from posttrain.chain.ops import checkpoint_step as step_of
from posttrain.chain.policy import ChainPolicy
from posttrain.publish import PublishConfig, Publisher, PublishError
from posttrain.publish.content import checkpoint_content
from posttrain.publish.ledger import Ledger, LedgerError, StepClaim, published_steps
from posttrain.publish.lock import WorkDirBusy
from posttrain.storage import LocalStore
from tests.support.tensors import perturb, random_tensor, save_torch_checkpoint


def _files(root) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def other_weights(tmp_path):
    """A checkpoint-3 of another run: same tensor names and shapes, other bytes."""
    rng = np.random.default_rng(99)
    state = {f"layer.{i}.weight": random_tensor(rng, "BF16", (256, 128)) for i in range(6)}
    state["norm"] = random_tensor(rng, "F32", (128,))
    state = {n: perturb(rng, t, 0.02) for n, t in state.items()}
    return save_torch_checkpoint(tmp_path / "alt" / "checkpoint-3", state, shards=2)


def test_other_weights_for_a_published_step_are_an_error(run_checkpoints, other_weights, tmp_path):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)
    with Publisher(store, config) as pub:
        for ckpt in run_checkpoints[:3]:
            assert pub.submit(ckpt) is None
        before = _files(tmp_path / "store")
        with pytest.raises(PublishError, match=r"step 3 of run r1 is already published as step-00000003-\w+ with "
                                               r"different weights; nothing was published"):
            pub.submit(other_weights)
        # the same weights again (a retry, here from a copy of the folder) stay a no-op
        copy = shutil.copytree(run_checkpoints[2], tmp_path / "copy" / "checkpoint-3")
        claim = pub.submit(copy)
        assert claim is not None and claim.identity == pub.published[2].identity
        assert pub.drain() == pub.published and len(pub.published) == 3
    assert _files(tmp_path / "store") == before
    assert {s: len(i) for s, i in published_steps(store, "r1").items()} == {1: 1, 2: 1, 3: 1}


def test_the_ledger_records_the_digest_of_the_weights(run_checkpoints, tmp_path):
    """The content digest the publisher compares is the one the encoder computed for the version."""
    store = LocalStore(tmp_path / "store")
    with Publisher(store, PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)) as pub:
        for ckpt in run_checkpoints[:3]:
            pub.submit(ckpt)
    ledger = Ledger(store, "r1")
    for step, ckpt in enumerate(run_checkpoints[:3], start=1):
        claim = ledger.claim(step)
        assert claim is not None and ledger.get(claim.identity).content == claim.content == checkpoint_content(ckpt)


def test_steps_come_from_the_checkpoint_never_a_silent_zero(run_checkpoints, tmp_path):
    assert step_of(run_checkpoints[3]) == 4
    named = shutil.copytree(run_checkpoints[0], tmp_path / "runA")
    with pytest.raises(NoStep, match=r"runA: no step in the folder's name \(checkpoint-<N>\) and no "
                                     r"trainer_state.json; give the step \(--step\)"):
        step_of(named)
    (named / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    assert step_of(named) == 7
    (named / "trainer_state.json").write_text(json.dumps({"global_step": None}))
    with pytest.raises(NoStep, match="global_step is None, not a step number"):
        step_of(named)
    store = LocalStore(tmp_path / "store")
    with Publisher(store, PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)) as pub:
        with pytest.raises(NoStep, match="runA"):
            pub.submit(named)
        with pytest.raises(PublishError, match="checkpoint .*nope does not exist"):
            pub.submit(tmp_path / "nope")
        pub.submit(named, step=1)  # a step given explicitly
    assert sorted(published_steps(store, "r1")) == [1]


def test_a_run_keeps_one_chain_policy_and_one_snapshot_per_step(run_checkpoints, tmp_path):
    """The work folder is lost and the publisher comes back with another policy: refused. With the
    same policy every step is found published (nothing uploaded) and the chain continues."""
    store = LocalStore(tmp_path / "store")
    first = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)
    with Publisher(store, first) as pub:
        done = [pub.publish_step(ckpt, step) for step, ckpt in enumerate(run_checkpoints[:4], start=1)]
    before = _files(tmp_path / "store")
    other = first.model_copy(update={"work_dir": tmp_path / "work2", "policy": ChainPolicy(max_deltas=2)})
    with Publisher(store, other) as pub, pytest.raises(LedgerError, match=(
            "run r1 is published with flavor coreweave, max_deltas 128, delta_budget 1; this publisher has "
            "flavor coreweave, max_deltas 2, delta_budget 1")):
        pub.submit(run_checkpoints[0])
    assert _files(tmp_path / "store") == before

    same = first.model_copy(update={"work_dir": tmp_path / "work3"})
    with Publisher(store, same) as pub:
        redo = [pub.publish_step(ckpt, step) for step, ckpt in enumerate(run_checkpoints[:4], start=1)]
        assert [(p.identity, p.uploaded_bytes) for p in redo] == [(p.identity, 0) for p in done]
        assert _files(tmp_path / "store") == before
        later = [pub.publish_step(ckpt, step) for step, ckpt in enumerate(run_checkpoints[4:], start=5)]
    assert [p.kind for p in later] == ["full", "delta"]  # no base in the new folder: a new chain starts
    assert {s: len(i) for s, i in published_steps(store, "r1").items()} == {s: 1 for s in range(1, 7)}


def test_an_older_unpublished_step_is_refused_even_from_a_new_work_folder(run_checkpoints, tmp_path):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)
    with Publisher(store, config) as pub:
        pub.submit(run_checkpoints[0])
        pub.submit(run_checkpoints[2])
    with Publisher(store, config.model_copy(update={"work_dir": tmp_path / "work2"})) as pub, \
            pytest.raises(PublishError, match="step 2 is not after the published step 3 of run r1"):
        pub.submit(run_checkpoints[1])


def test_run_names_are_one_path_segment(tmp_path, run_checkpoints):
    """A run named ``a/ledger`` would list inside run ``a``'s ledger: refused."""
    for bad in ("a/ledger", "", "../a", ".hidden", "a b"):
        with pytest.raises(ValidationError, match="run"):
            PublishConfig(run=bad, work_dir=tmp_path / "work")
        with pytest.raises(LedgerError, match="one path segment"):
            Ledger(LocalStore(tmp_path / "store"), bad)
    store = LocalStore(tmp_path / "store")
    with Publisher(store, PublishConfig(run="a", work_dir=tmp_path / "work", async_publish=False)) as pub:
        pub.submit(run_checkpoints[0])
    # a key below the ledger folder (written by hand, or by an older version) does not break it
    store.put_bytes(".posttrain/runs/a/ledger/ledger/x.json", b"{}")
    assert [e.step for e in Ledger(store, "a").entries()] == [1]


def test_a_second_publisher_on_a_work_folder_fails_fast_naming_the_holder(tmp_path):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work")
    holder = Publisher(store, config)
    with pytest.raises(WorkDirBusy, match=rf"work dir {tmp_path / 'work'} is in use by another publisher "
                                          rf"\(pid {os.getpid()}\)$"):
        Publisher(store, config)
    with pytest.raises(WorkDirBusy, match=r"after waiting 0.2s"):
        Publisher(store, config.model_copy(update={"lock_timeout": 0.2}))
    threading.Timer(0.3, holder.close).start()
    Publisher(store, config.model_copy(update={"lock_timeout": 10})).close()  # waits for the holder


def test_a_work_dir_that_is_a_file_is_one_error(tmp_path):
    (tmp_path / "file").touch()
    with pytest.raises(PublishError, match=f"work dir {tmp_path / 'file'} is not a folder"):
        Publisher(LocalStore(tmp_path / "store"), PublishConfig(run="r1", work_dir=tmp_path / "file"))
    under = tmp_path / "file" / "sub" / "work"  # a parent is a file: named, not "Not a directory"
    with pytest.raises(PublishError) as err:
        Publisher(LocalStore(tmp_path / "store"), PublishConfig(run="r1", work_dir=under))
    assert str(err.value) == f"work dir {under}: {tmp_path / 'file'} is a file, not a folder"


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write(2) raises it: no file name


@pytest.mark.parametrize("async_publish", [False, True])
def test_a_full_store_names_the_file(run_checkpoints, tmp_path, monkeypatch, async_publish):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=async_publish)
    with Publisher(store, config) as pub:
        pub.submit(run_checkpoints[0])
        pub.drain()
        monkeypatch.setattr("posttrain.storage.local.shutil.copyfile", _enospc)
        with pytest.raises((PublishError, OSError)) as info:
            pub.submit(run_checkpoints[1])
            pub.drain()
    shown = str(info.value) if isinstance(info.value, PublishError) else f"{info.value.filename}"
    assert f"{tmp_path / 'store'}/step-00000002-" in shown
    monkeypatch.undo()
    with Publisher(store, config) as pub:  # space again: the next run finishes the job
        pub.resume()
        pub.submit(run_checkpoints[1])
        pub.drain()
    assert {s: len(i) for s, i in published_steps(store, "r1").items()} == {1: 1, 2: 1}


def test_a_full_work_dir_names_the_folder(run_checkpoints, tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=True)
    monkeypatch.setattr("posttrain.publish.publisher.ChainWriter.add", _enospc)
    with Publisher(store, config) as pub, pytest.raises(
            PublishError, match=f"^publishing failed: {tmp_path / 'work' / 'chain'}: No space left on device$"):
        pub.submit(run_checkpoints[0])
        pub.drain()


class RacingStore(LocalStore):
    """Another publisher claims step 1 while this one uploads it."""

    def put_file(self, local_path, key: str) -> None:
        super().put_file(local_path, key)
        if key.endswith("model.safetensors.index.json") and not self.exists(".posttrain/runs/r1/steps/"
                                                                             "000000000001.json"):
            Ledger(self, "r1").claim_step(StepClaim(step=1, identity="step-00000001-other", content="x"))


def test_a_step_claimed_meanwhile_withdraws_this_snapshot(run_checkpoints, tmp_path):
    store = RacingStore(tmp_path / "store")
    with Publisher(store, PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)) as pub, \
            pytest.raises(PublishError, match=r"step 1 of run r1 was published meanwhile as step-00000001-other "
                                              r"\(different weights\) by another publisher; step-00000001-\w+ was "
                                              "withdrawn"):
        pub.submit(run_checkpoints[0])
    assert published_steps(store, "r1") == {}


def test_a_full_snapshot_of_a_published_step_joins_its_claim(run_checkpoints, tmp_path):
    store = LocalStore(tmp_path / "store")
    with Publisher(store, PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False)) as pub:
        first = [pub.publish_step(ckpt, step) for step, ckpt in enumerate(run_checkpoints[:2], start=1)]
        full = pub.publish_full()
    assert full.step == 2 and full.kind == "full" and full.identity != first[1].identity
    assert Ledger(store, "r1").claim(2).identity == first[1].identity
    assert published_steps(store, "r1")[2] == sorted([first[1].identity, full.identity],
                                                     key=lambda i: i != first[1].identity)


@pytest.mark.parametrize("point", ["after_ledger:2", "after_claim:2", "after_claim:4"])
def test_killed_between_ledger_claim_and_latest_finishes_when_run_again(run_checkpoints, tmp_path, point):
    """The step claim is written between the ledger entry and ``latest``: a publisher killed around it
    finishes the job when run again (a folder store; tests/publish/test_publisher.py does every crash
    point on S3)."""
    import signal
    import subprocess

    from tests.publish.test_publisher import check_store, publish_cmd

    cmd = publish_cmd(str(tmp_path / "store"), tmp_path / "work", run_checkpoints, None)
    crashed = subprocess.run(cmd, env={**os.environ, "POSTTRAIN_CRASH_AT": point}, capture_output=True, text=True)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    check_store(LocalStore(tmp_path / "store"), run_checkpoints, tmp_path, "crash")
