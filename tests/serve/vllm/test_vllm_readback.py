"""The vLLM gateway proves by digests read back from inside REAL vLLM (CPU build) which weights each replica
holds, exactly: versions one training step apart at lr 1e-6 (closer than any tolerance on answers) are told
apart at the switch and by the monitor, whether vLLM computes in float32 or in bfloat16 (what its default
``--dtype auto`` makes of float32 weights on CPU); a reload whose loader skips a tensor, re-serves cached
weights or whose model takes nothing is caught (injected by a worker extension of this test's,
``posttrain.testing.vllm_readback_faults``); NaN weights are refused. None of the snapshots here carries the
trainer's probe file: the digests stand alone."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from posttrain.inference.contract import HotLoadFailed
from posttrain.serve.vllm.client import VLLMClient
from posttrain.serve.weight_digest import compare, held_expected
from posttrain.testing import vllm_readback_faults as faults
from tests.support.updates import nan_weights
from tests.support.vllm import require_vllm
from tests.support.vllm_readback import (
    EMBEDDINGS,
    arm_fault,
    cli_vllm_dtype,
    faulty_vllm,
    readback_chain,
    readback_gateway,
    served_identity,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()
NORM = "model.norm.weight"
# one step at lr 1e-6 moves every float32 weight; cast to bfloat16 the norms (near 1.0) round back to the
# same values, but ~4% of the changed embedding values do not (EMBEDDINGS): the tensor both dtypes tell apart
UP_PROJ = "model.layers.0.mlp.up_proj.weight"
MONITOR_WAIT_S = 300.0  # the monitor's put-back reloads in place; a loaded machine can still take minutes


@pytest.fixture(scope="module", params=["float32", "default"])
def setup(request, tmp_path_factory):
    """A gateway over one vLLM replica computing in float32, or in what the CLI's default dtype makes it."""
    tmp = tmp_path_factory.mktemp(f"readback-{request.param}")
    chain = readback_chain(tmp / "chain")
    fault_file = tmp / "fault.json"
    mp = pytest.MonkeyPatch()
    mp.setenv(faults.FAULT_ENV, str(fault_file))  # vLLM inherits it: read by the faulty extension
    dtype = "float32" if request.param == "float32" else cli_vllm_dtype()
    server = readback_gateway(chain, tmp / "work", faulty_vllm(tmp).model_copy(update={"dtype": dtype}))
    yield {"chain": chain, "server": server, "fault": fault_file, "tmp": tmp, "dtype": request.param}
    server.shutdown()
    mp.undo()


def test_the_default_dtype_is_auto_and_vllm_computes_float32_weights_in_half_precision(setup):
    engine = setup["server"].engine
    if setup["dtype"] == "default":
        assert cli_vllm_dtype() == "auto"
        assert engine.engine_dtype in ("bfloat16", "float16")  # asked of vLLM, not assumed
    else:
        assert engine.engine_dtype == "float32"


@pytest.mark.parametrize("mode", ["ignore", "cached", "drop"])
def test_a_reload_that_leaves_the_previous_version_is_refused_naming_the_tensors(setup, mode, make_client):
    chain, server = setup["chain"], setup["server"]
    loader = make_client(server, timeout=300, fallback_to_full=False)
    if served_identity(server) != chain["ids"][0]:
        loader.hot_load(chain["ids"][0])
    arm_fault(setup["fault"], mode=mode, tensor=UP_PROJ)
    with pytest.raises(HotLoadFailed) as info:
        loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0])
    reason = str(info.value)
    assert f"not {Path(chain['ids'][1]).name}" in reason or "are not" in reason, reason
    if mode == "drop":
        assert f"{UP_PROJ} missing" in reason, reason
    elif mode == "cached":
        assert "the tensors its loader read" in reason and "differs" in reason, reason
    else:  # everything read was right; the parameters in memory are still N-1's
        assert "its parameters" in reason and EMBEDDINGS in reason, reason
    assert not setup["fault"].exists()  # the fault was used by this load
    assert served_identity(server) == chain["ids"][0]  # put back, and stamped so
    assert not server.engine.replica_errors()
    assert loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0]).identity == chain["ids"][1]


def test_the_monitor_finds_a_replica_put_back_on_the_previous_version_and_restores_it(setup, make_client):
    chain, server = setup["chain"], setup["server"]
    loader = make_client(server, timeout=300, fallback_to_full=False)
    if served_identity(server) != chain["ids"][1]:
        if served_identity(server) != chain["ids"][0]:
            loader.hot_load(chain["ids"][0])
        loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0])
    replica = server.engine.replicas[0]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    holding = logging.getLogger("posttrain.serve.holding")
    level = holding.level
    holding.setLevel(logging.INFO)  # "is back on" is said at INFO
    holding.addHandler(handler)
    try:
        # behind the gateway's back, with vLLM's own reload: the identity the extension keeps is unchanged
        direct = VLLMClient(replica.process.url)
        direct.pause()
        direct._json("POST", "/collective_rpc", json={"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(chain["models"][0])}})
        direct.resume()
        direct.close()
        deadline = time.monotonic() + MONITOR_WAIT_S
        while time.monotonic() < deadline and not any("is back on" in r for r in records):
            time.sleep(0.2)
        found = [r for r in records if "putting it back" in r]
        assert found and "are not" in found[0] and EMBEDDINGS in found[0], records
        assert any("is back on" in r for r in records), records
    finally:
        holding.removeHandler(handler)
        holding.setLevel(level)
    assert served_identity(server) == chain["ids"][1]
    # put back by an in-place reload of the served folder (seconds, not a restart's minute): it holds it,
    # and names that reload
    held = replica.client.read_held(replica.readback)
    served = server.engine.current().path
    assert held.identity == served.name
    assert not any("restarting it" in r for r in records), records
    assert compare(held_expected(served, replica.readback, held.dtype), held.tensors, what="held",
                   version=served.name)


def test_nan_weights_are_refused_and_the_served_version_stays(setup, make_client):
    chain, server = setup["chain"], setup["server"]
    loader = make_client(server, timeout=300, fallback_to_full=False)
    before = served_identity(server)
    poisoned = chain["writer"].add(nan_weights(chain["models"][1], setup["tmp"] / "nan", NORM), step=5)
    on = {"base_identity": chain["ids"][1]} if poisoned.kind == "delta" else {}
    with pytest.raises(HotLoadFailed, match="NaN"):
        loader.hot_load(poisoned.identity, **on)
    assert served_identity(server) == before
