"""Fixtures of the publisher tests: the checkpoints of a small training run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.tensors import perturb, random_tensor, save_torch_checkpoint


@pytest.fixture
def run_checkpoints(tmp_path):
    """Six checkpoints of a training run, a few bytes of each tensor changing per step."""
    rng = np.random.default_rng(5)
    state = {f"layer.{i}.weight": random_tensor(rng, "BF16", (256, 128)) for i in range(6)}
    state["norm"] = random_tensor(rng, "F32", (128,))
    out = []
    for step in range(1, 7):
        state = {n: perturb(rng, t, 0.02) for n, t in state.items()}
        out.append(save_torch_checkpoint(tmp_path / "output" / f"checkpoint-{step}", state, shards=2))
    return out
