"""Fixtures of the publisher tests: the checkpoints of a small training run, and a store of five
nightly runs for the gc tests."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from posttrain.storage import LocalStore
from tests.support.chains import publish_runs
from tests.support.tensors import perturb, random_tensor, save_torch_checkpoint


@pytest.fixture(scope="module")
def nightly_template(tmp_path_factory):
    """Five nightly runs, each [full 1, delta 2, delta 3, delta 4] and [full 5], in a folder store."""
    root = tmp_path_factory.mktemp("nightly")
    done = publish_runs(LocalStore(root / "store"), root)
    return root, done


@pytest.fixture
def nightly(nightly_template, tmp_path):
    """A fresh copy of the five runs' store, and what was published."""
    root, done = nightly_template
    shutil.copytree(root / "store", tmp_path / "store")
    return LocalStore(tmp_path / "store"), done


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
