"""gc against a serving deployment (docs/retention.md): a store of five nightly chains of real tiny
models, gc keeping two runs while the reference server is half-way through hot-loading a version
of a run gc empties; the load completes and answers as the version's own weights do, and afterwards
every kept version and the served one hot-load into a fresh server from the store alone."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.policy import ChainPolicy
from posttrain.inference.protocol import API_PREFIX, STATE_RUNNING
from posttrain.promote.promoter import load_version
from posttrain.publish import PublishConfig, Publisher
from posttrain.publish.gc import GcConfig, plan_gc, run_gc
from posttrain.storage import LocalStore
from tests.support.chains import snapshots_in
from tests.support.serving import PROMPT, Api, Chain, local_greedy, start_server

RUNS, STEPS = 5, 4  # chains [full 1, delta 2, delta 3, delta 4] (max_deltas 3)


def _runs_of_models(base: Path, root: Path) -> dict[str, list[tuple[int, str, Path]]]:
    """Five nightly runs published one after another; each step perturbs layer 0 of the step before,
    so a delta holds layer 0 only. run -> [(step, identity, checkpoint folder)]."""
    import torch
    from transformers import AutoModelForCausalLM

    store = LocalStore(root / "store")
    runs: dict[str, list[tuple[int, str, Path]]] = {}
    for n in range(RUNS):
        run = f"night-{n}"
        model = AutoModelForCausalLM.from_pretrained(base)
        gen = torch.Generator().manual_seed(100 + n)
        config = PublishConfig(run=run, work_dir=root / run / "work", async_publish=False,
                               policy=ChainPolicy(max_deltas=3))
        with Publisher(store, config) as pub:
            for step in range(1, STEPS + 1):
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if ".layers.0." in name:
                            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
                ckpt = root / run / f"checkpoint-{step}"
                model.save_pretrained(ckpt)
                p = pub.publish_step(ckpt, step)
                runs.setdefault(run, []).append((step, p.identity, ckpt))
    return runs


@pytest.fixture(scope="module")
def nightly_models(chain: Chain, tmp_path_factory):
    root = tmp_path_factory.mktemp("gc-serving")
    return root / "store", _runs_of_models(chain.models[0], root)


def _served_roots(client) -> dict[str, str]:
    """What the nightly's gc task protects for a deployment (pipeline/tasks/retention.py served_roots)."""
    return {identity: "served by staging" for identity in client.served_identities()}


def test_gc_during_a_hot_load_and_every_kept_version_hot_loads_after(nightly_models, chain, make_client,
                                                                     tmp_path):
    store_dir, runs = nightly_models
    store = LocalStore(store_dir)
    identity = {(run, step): i for run, steps in runs.items() for step, i, _ in steps}
    checkpoint = {i: ckpt for steps in runs.values() for _, i, ckpt in steps}
    loading = identity[("night-0", 2)]  # a delta of the oldest run: gc empties that run around it

    staging = start_server(chain, tmp_path / "staging", store_dir, prefix="")
    try:
        api, client = Api(staging.url), make_client(staging)
        # the load stops for a while once it has fetched the chain's full snapshot and not yet its delta
        api.faults({"kind": "delay_hotload", "seconds": 4.0, "after_fetched": 1})
        done: dict = {}

        def hot_load() -> None:
            try:
                done["result"] = load_version(client, store, loading)
            except Exception as e:  # noqa: BLE001 - asserted below
                done["error"] = e

        load = threading.Thread(target=hot_load)
        load.start()
        op_id = _wait_running(api, loading)
        _wait_file(tmp_path / "staging" / "cache" / identity[("night-0", 1)] / INDEX_NAME)  # the full is fetched
        roots = _served_roots(client)  # the unfinished load's identity counts as served
        assert roots == {loading: "served by staging"}
        plan = plan_gc(store, GcConfig(keep_runs=2), roots=roots)
        result = run_gc(store, plan)
        still = api.get(f"{API_PREFIX}/{op_id}").json()["hotLoad"]["status"]["state"]
        load.join(timeout=60)
        assert still == STATE_RUNNING  # gc ran while the load was half-way through the chain
        assert "error" not in done, done.get("error")
        assert done["result"].identity == loading
        assert api.greedy() == local_greedy(checkpoint[loading], PROMPT)
    finally:
        staging.shutdown()

    assert result.skipped == {} and plan.held_back() == {loading: "served by staging"}
    kept = {identity[(run, s)] for run in ("night-3", "night-4") for s in range(1, STEPS + 1)}
    prefix = {identity[("night-0", 1)], loading}
    assert snapshots_in(store) == kept | prefix  # night-0's steps 3, 4 and runs 1, 2 are gone
    assert {d.identity for d in result.deleted} == set(identity.values()) - kept - prefix

    # a fresh server (nothing cached) loads each kept version and the served one from the store,
    # alternating between chains so each load rebuilds from another chain's full snapshot
    fresh = start_server(chain, tmp_path / "fresh", store_dir, prefix="")
    try:
        api, client = Api(fresh.url), make_client(fresh)
        order = [loading] + [identity[(run, s)] for s in range(STEPS, 0, -1) for run in ("night-3", "night-4")]
        answers = {}
        for version in order:
            assert load_version(client, store, version).identity == version
            answers[version] = api.greedy()
            assert answers[version] == local_greedy(checkpoint[version], PROMPT), version
        assert len({tuple(a) for a in answers.values()}) > 1  # the versions do answer differently
    finally:
        fresh.shutdown()


def _wait_running(api: Api, identity: str, timeout: float = 30) -> str:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for op in api.ops():
            if op["spec"]["identity"] == identity and op["status"]["state"] == STATE_RUNNING:
                return op["spec"]["id"]
        time.sleep(0.02)
    raise AssertionError(f"no RUNNING hot-load of {identity} within {timeout} s")


def _wait_file(path: Path, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.02)
