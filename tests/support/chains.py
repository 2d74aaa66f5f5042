"""Stores holding the chains of several nightly runs, published by the real ``Publisher``.

Each run publishes ``steps`` small synthetic checkpoints (numpy, no torch) with
``max_deltas=3``: with 5 steps, chains [full 1, delta 2, delta 3, delta 4] and [full 5]. Runs
publish one after another, so run ``night-0`` is the oldest and the last one the newest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.fetch import reconstruct_from_store
from posttrain.chain.policy import ChainPolicy
from posttrain.publish import PublishConfig, Publisher
from posttrain.publish.content import checkpoint_content
from posttrain.publish.ledger import Ledger
from posttrain.storage import Store
from posttrain.testing.synthetic import run_checkpoints

DAY = 86400.0


@dataclass
class Nightly:
    """What was published: run -> [(step, identity, kind, base)], and each version's checkpoint."""

    runs: dict[str, list[tuple[int, str, str, str | None]]] = field(default_factory=dict)
    checkpoints: dict[str, Path] = field(default_factory=dict)  # identity -> checkpoint folder

    def identities(self, run: str) -> list[str]:
        return [i for _, i, _, _ in self.runs[run]]

    def all_identities(self) -> set[str]:
        return {i for run in self.runs for i in self.identities(run)}


def checkpoints(root: Path, seed: int, steps: int) -> list[Path]:
    """``steps`` checkpoints of a run: four small bf16 tensors, a few of their bytes changing each step."""
    return run_checkpoints(root, seed, steps)


def publish_runs(store: Store, root: Path, *, runs: int = 5, steps: int = 5, first: int = 0) -> Nightly:
    """Publish ``runs`` nightly runs (``night-<first>`` ...) into ``store``, oldest first."""
    done = Nightly()
    for n in range(first, first + runs):
        run = f"night-{n}"
        publish_run(store, root, run, checkpoints(root / run / "output", seed=n, steps=steps), done)
    return done


def publish_run(store: Store, root: Path, run: str, ckpts: list[Path], done: Nightly | None = None) -> Nightly:
    """Publish the checkpoint folders ``ckpts`` (synthetic ones, or models a server can load) as
    steps 1, 2, ... of ``run``, recording them in ``done``."""
    done = Nightly() if done is None else done
    config = PublishConfig(run=run, work_dir=root / run / "work", async_publish=False, policy=ChainPolicy(max_deltas=3))
    with Publisher(store, config) as pub:
        for step, ckpt in enumerate(ckpts, start=1):
            p = pub.publish_step(ckpt, step)
            done.runs.setdefault(run, []).append((p.step, p.identity, p.kind, p.base))
            done.checkpoints[p.identity] = ckpt
    time.sleep(0.01)  # distinct publication times between runs
    return done


def age_run(store: Store, run: str, days: float) -> None:
    """Move every publication of ``run`` ``days`` into the past (as if published then)."""
    ledger = Ledger(store, run)
    for e in ledger.entries():
        ledger.put(e.model_copy(update={"published_at": e.published_at - days * DAY}))


def snapshots_in(store: Store) -> set[str]:
    """Identities with an index (the commit marker) in the store."""
    return {k.split("/")[0] for k in store.list() if k.endswith("/" + INDEX_NAME) and not k.startswith(".")}


def keys_of(store: Store, identity: str) -> list[str]:
    return list(store.list(f"{identity}/"))


def rebuilds(store: Store, identity: str, tmp: Path) -> str:
    """Rebuild ``identity`` from the store alone (a fresh cache, every checksum checked); the
    content digest of the weights it rebuilt, to compare with ``checkpoint_content`` of the original."""
    stamp = time.monotonic_ns()
    out = tmp / f"rebuilt-{stamp}"
    reconstruct_from_store(store, identity, out, cache_dir=tmp / f"cache-{stamp}")
    return checkpoint_content(out)


def store_files(store) -> dict[str, int]:
    """Every file of a folder store (its own lock files aside), with its modification time."""
    return {str(p): p.stat().st_mtime_ns for p in sorted(store.root.rglob("*")) if p.is_file()
            and ".posttrain-store" not in p.parts}
