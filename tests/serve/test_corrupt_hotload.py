"""The real reference server never serves a corrupt snapshot: random byte flips in any file of
any snapshot of the store fail the hot-load, by name, and the served version stays; once the
store is whole again the same server loads the chain."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.inference.contract import HotLoadFailed
from posttrain.inference.protocol import API_PREFIX, STATE_FAILED
from tests.support.serving import PREFIX, PROMPT, Api

TRIALS = 100  # about 0.2 s each; tests/chain/test_corruption.py runs 100 more through the chain and fetch layers


def flip(path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def test_random_byte_flips_never_reach_the_served_model(make_server, make_client, chain, store_copy):
    from posttrain.chain.writer import ChainWriter

    writer = ChainWriter(store_copy / PREFIX, run="r1")  # full, delta, delta, then a full and a delta
    full4 = writer.add(chain.models[2], step=3, restart=True)
    d5 = writer.add(chain.models[0], base=chain.models[2], step=4)
    assert (full4.kind, d5.kind) == ("full", "delta")
    snapshots = [chain.full, chain.d1, chain.d2, full4.identity, d5.identity]
    leaf = {chain.full: chain.d2, chain.d1: chain.d2, chain.d2: chain.d2,
            full4.identity: d5.identity, d5.identity: d5.identity}
    base = {chain.d2: chain.d1, d5.identity: full4.identity}
    folder = store_copy / PREFIX
    files = {s: sorted(p.name for p in (folder / s).iterdir()) for s in snapshots}

    server = make_server(store=store_copy)
    api = Api(server.url)
    client = make_client(server, fallback_to_full=False)
    served = api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"]
    rng = np.random.default_rng(11)
    for trial in range(TRIALS):
        snapshot = snapshots[rng.integers(len(snapshots))]
        fname = files[snapshot][rng.integers(len(files[snapshot]))]
        path = folder / snapshot / fname
        offset, mask = int(rng.integers(path.stat().st_size)), int(rng.integers(1, 256))
        where = f"trial {trial}: {snapshot}/{fname} byte {offset} ^ {mask:#04x}"
        flip(path, offset, mask)
        try:
            with pytest.raises(HotLoadFailed) as info:
                client.hot_load(leaf[snapshot], base_identity=base.get(leaf[snapshot]))
        finally:
            flip(path, offset, mask)
        op = api.get(f"{API_PREFIX}/{info.value.operation_id}").json()["hotLoad"]
        assert op["status"]["state"] == STATE_FAILED, where
        message = op["status"]["conditions"][0]["message"]
        assert f"snapshot {snapshot}" in message and fname in message, f"{where}: {message}"
        assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == served, where
        assert api.greedy() == chain.greedy[0], where

    # whole again: nothing of the failed loads is left in the server's cache to fail the next one
    client.hot_load(d5.identity, base_identity=full4.identity)
    assert api.greedy() == chain.greedy[0]
    assert api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"] == d5.identity
    client.hot_load(chain.d2, base_identity=chain.d1)
    assert api.greedy() == chain.greedy[2]


def test_whoever_sees_a_hot_load_failed_reads_its_replicas_back_on_the_served_version(
        make_server, make_client, chain, store_copy):
    """The replicas' state is set before the operation's FAILED (a client that read FAILED then read the
    replicas LOADING: the vLLM-at-a-URL test, CI 2026-12-07)."""
    server = make_server(store=store_copy)
    seen: list[list[str]] = []
    service, set_state = server.service, server.service._set

    def recording(op, state):
        if state == STATE_FAILED:
            seen.append([r.state for r in service.replica_states()])
        set_state(op, state)

    service._set = recording
    first = sorted((store_copy / PREFIX / chain.full).iterdir())[0]
    flip(first, 0, 0xFF)
    with pytest.raises(HotLoadFailed):
        make_client(server, fallback_to_full=False).hot_load(chain.full)
    assert seen == [["READY"]]
