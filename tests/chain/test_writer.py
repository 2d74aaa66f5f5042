"""The chain policy, as a producer feeding checkpoints in step order sees it."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from posttrain.chain.ops import reconstruct, verify_chain
from posttrain.chain.policy import ChainPolicy
from posttrain.chain.writer import ChainWriter
from tests.support.tensors import load_bytes, perturb, random_tensor, save_torch_checkpoint


@pytest.fixture
def steps(tmp_path):
    """Checkpoints of a run: each step flips a few bytes of every tensor."""
    rng = np.random.default_rng(3)
    state = {f"w{i}": random_tensor(rng, "BF16", (64, 64)) for i in range(4)}
    out = []
    for step in range(1, 13):
        state = {n: perturb(rng, t, 0.01) for n, t in state.items()}
        out.append(save_torch_checkpoint(tmp_path / f"checkpoint-{step}", state))
    return out


def feed(writer: ChainWriter, ckpts, **kw):
    records, prev = [], None
    for c in ckpts:
        records.append(writer.add(c, base=prev, **kw))
        prev = c
    return records


def test_first_full_then_deltas_until_max_deltas(steps, tmp_path):
    w = ChainWriter(tmp_path / "chain", policy=ChainPolicy(max_deltas=4, delta_budget=100))
    kinds = [r.kind for r in feed(w, steps)]
    assert kinds == ["full", "delta", "delta", "delta", "delta"] * 2 + ["full", "delta"]
    written = sorted((w.record(p.name) for p in w.chain_dir.iterdir() if not p.name.startswith(".")),
                     key=lambda r: r.step)
    assert len(written) == 12
    for r, ckpt in zip(written, steps, strict=True):
        out = tmp_path / f"out-{r.identity}"
        reconstruct(tmp_path / "chain", r.identity, out)
        assert load_bytes(out) == load_bytes(ckpt)
    verify_chain(tmp_path / "chain")


def test_budget_starts_a_full_snapshot_before_max_deltas(steps, tmp_path):
    w = ChainWriter(tmp_path / "chain", policy=ChainPolicy(delta_budget=0.25))
    records = feed(w, steps)
    kinds = [r.kind for r in records]
    assert kinds[0] == "full" and "full" in kinds[1:]
    # between fulls, stored delta bytes never exceed a quarter of the full snapshot
    full_bytes = 0
    since = 0
    for r in records:
        if r.kind == "full":
            full_bytes, since = r.stored_bytes, 0
        else:
            since += r.stored_bytes
            assert since <= 0.25 * full_bytes
    assert any("budget" in r.reason for r in records if r.kind == "full")


def test_layout_change_restart_and_missing_base_give_full_snapshots(steps, tmp_path):
    w = ChainWriter(tmp_path / "chain")
    assert w.add(steps[0]).kind == "full"
    assert w.add(steps[1], base=steps[0]).kind == "delta"
    r = w.add(steps[2], base=steps[1], restart=True)
    assert (r.kind, r.reason) == ("full", "explicit restart")
    r = w.add(steps[3])
    assert r.kind == "full" and "restarted" in r.reason
    # a base that is not the head's bytes (steps[0] instead of steps[3]) is caught by digests
    r = w.add(steps[4], base=steps[0])
    assert r.kind == "full" and "differ from the chain head" in r.reason
    import torch

    changed = save_torch_checkpoint(tmp_path / "checkpoint-99", {"other": torch.zeros(3)})
    r = w.add(changed, base=steps[4])
    assert r.kind == "full" and "changed" in r.reason


def test_redoing_a_step_returns_the_same_snapshot(steps, tmp_path):
    w = ChainWriter(tmp_path / "chain")
    a = w.add(steps[0])
    b = w.add(steps[1], base=steps[0])
    again = ChainWriter(tmp_path / "chain").add(steps[1], base=steps[0])
    assert again == b
    assert sorted(p.name for p in (tmp_path / "chain").iterdir() if not p.name.startswith(".")) == sorted(
        [a.identity, b.identity])


def test_slime_writer_numbers_versions(steps, tmp_path):
    w = ChainWriter(tmp_path / "disk", flavor="slime", policy=ChainPolicy(max_deltas=2))
    records = feed(w, steps[:4])
    assert [r.identity for r in records] == [f"weight_v{i:06d}" for i in range(1, 5)]
    assert [r.kind for r in records] == ["full", "delta", "delta", "full"]
    reconstruct(tmp_path / "disk", "3", tmp_path / "v3")
    assert load_bytes(tmp_path / "v3") == load_bytes(steps[2])


@pytest.mark.parametrize("field,value", [("max_deltas", 129), ("max_deltas", -1), ("delta_budget", 0),
                                         ("unknown", 1)])
def test_policy_settings_are_validated(field, value):
    with pytest.raises(ValidationError, match=field):
        ChainPolicy(**{field: value})
