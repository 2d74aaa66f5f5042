"""The vLLM gateway proves by digests read back from inside REAL vLLM (CPU build) which weights each replica
holds, exactly: versions one training step apart at lr 1e-6 (closer than any tolerance on answers) are told
apart at the switch and by the monitor, whether vLLM computes in float32 or in bfloat16 (what its default
``--dtype auto`` makes of float32 weights on CPU); a reload whose loader skips a tensor, re-serves cached
weights or whose model takes nothing is caught (injected by a worker extension of this test's,
``posttrain.testing.vllm_readback_faults``); NaN weights are refused. None of the snapshots here carries the
trainer's probe file: the digests stand alone."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from pydantic import SecretStr

from posttrain.chain.policy import ChainPolicy
from posttrain.chain.writer import ChainWriter
from posttrain.cli.serve import register as register_serve
from posttrain.inference.contract import HotLoadFailed
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.server import InferenceServer
from posttrain.serve.vllm.client import VLLMClient
from posttrain.serve.vllm.process import VLLMProcessConfig
from posttrain.serve.weight_digest import compare, held_expected
from posttrain.testing import vllm_readback_faults as faults
from tests.support.serving import DEPLOYMENT, PREFIX, TOKEN, Api
from tests.support.updates import nan_weights, one_update
from tests.support.vllm import require_vllm, served_greedy, vllm_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()
NORM = "model.norm.weight"
# one step at lr 1e-6 moves every float32 weight; cast to bfloat16 the norms (near 1.0) round back to the
# same values, but ~4% of the changed embedding values do not: the tensor both dtypes tell apart in memory
EMBEDDINGS = "model.embed_tokens.weight"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"
MONITOR_WAIT_S = 300.0  # the monitor's put-back restarts the supervised vLLM: a minute or more on a loaded machine


def _chain(root: Path, dtype: str = "float32") -> dict:
    """A boot model and the same model after one AdamW step at lr 1e-6 (``dtype``: how both are saved)."""
    m0 = vllm_model(root / "m0")
    if dtype != "float32":
        m0 = one_update(m0, root / f"m0-{dtype}", lr=0.0, dtype=dtype)  # the boot weights in that dtype
    m1 = one_update(m0, root / "m1", lr=1e-6, dtype=dtype)
    writer = ChainWriter(root / "store" / PREFIX, run="r", policy=ChainPolicy(delta_budget=100.0))
    snaps = [writer.add(m0, step=0), writer.add(m1, base=m0, step=1)]
    return {"models": [m0, m1], "ids": [s.identity for s in snaps], "store": root / "store", "writer": writer,
            "root": root}


def _faulty(tmp: Path) -> VLLMProcessConfig:
    """vLLM settings that load the test's faulty readback extension (beside the real one)."""
    folder = tmp / "ext"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(faults.__file__, folder / f"{faults.MODULE}.py")
    return VLLMProcessConfig(worker_extension=faults.CLS, extension_path=[folder], log_file=tmp / "vllm.log")


def _cli_vllm_dtype() -> str:
    """The dtype `posttrain serve --engine vllm` gives vLLM when none is named."""
    import argparse

    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--engine", "vllm", "--model", "m", "--deployment-id", "d", "--store", "s"])
    return args.engine_dtype


def _gateway(chain: dict, work: Path, vllm: VLLMProcessConfig) -> InferenceServer:
    config = ServeConfig(model_dir=chain["models"][0], served_model_name="tiny", port=0, deployment_id=DEPLOYMENT,
                         store=str(chain["store"]), prefix=PREFIX, token=SecretStr(TOKEN), work_dir=work,
                         engine="vllm", vllm=vllm.model_copy(update={"served_model_name": "tiny"}),
                         probe_interval_s=0.5)
    return InferenceServer(config).start()


def _arm(path: Path, **fault) -> None:
    """The next in-place reload misbehaves as ``fault`` says (``posttrain.testing.vllm_readback_faults``)."""
    path.write_text(json.dumps(fault))


@pytest.fixture(scope="module", params=["float32", "default"])
def setup(request, tmp_path_factory):
    """A gateway over one vLLM replica computing in float32, or in what the CLI's default dtype makes it."""
    tmp = tmp_path_factory.mktemp(f"readback-{request.param}")
    chain = _chain(tmp / "chain")
    fault_file = tmp / "fault.json"
    mp = pytest.MonkeyPatch()
    mp.setenv(faults.FAULT_ENV, str(fault_file))  # vLLM inherits it: read by the faulty extension
    dtype = "float32" if request.param == "float32" else _cli_vllm_dtype()
    server = _gateway(chain, tmp / "work", _faulty(tmp).model_copy(update={"dtype": dtype}))
    yield {"chain": chain, "server": server, "fault": fault_file, "tmp": tmp, "dtype": request.param}
    server.shutdown()
    mp.undo()


def _served(server) -> str | None:
    return served_greedy(Api(server.url))[1]


def test_the_default_dtype_is_auto_and_vllm_computes_float32_weights_in_half_precision(setup):
    engine = setup["server"].engine
    if setup["dtype"] == "default":
        assert _cli_vllm_dtype() == "auto"
        assert engine.engine_dtype in ("bfloat16", "float16")  # asked of vLLM, not assumed
    else:
        assert engine.engine_dtype == "float32"


@pytest.mark.parametrize("mode", ["ignore", "cached", "drop"])
def test_a_reload_that_leaves_the_previous_version_is_refused_naming_the_tensors(setup, mode, make_client):
    chain, server = setup["chain"], setup["server"]
    loader = make_client(server, timeout=300, fallback_to_full=False)
    if _served(server) != chain["ids"][0]:
        loader.hot_load(chain["ids"][0])
    _arm(setup["fault"], mode=mode, tensor=UP_PROJ)
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
    assert _served(server) == chain["ids"][0]  # put back, and stamped so
    assert not server.engine.replica_errors()
    assert loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0]).identity == chain["ids"][1]


def test_the_monitor_finds_a_replica_put_back_on_the_previous_version_and_restores_it(setup, make_client):
    chain, server = setup["chain"], setup["server"]
    loader = make_client(server, timeout=300, fallback_to_full=False)
    if _served(server) != chain["ids"][1]:
        if _served(server) != chain["ids"][0]:
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
    assert _served(server) == chain["ids"][1]
    # put back by restarting the engine on the served folder: it holds it, and names no reload of its own
    held = replica.client.read_held(replica.readback)
    served = server.engine.current().path
    assert held.identity is None
    assert compare(held_expected(served, replica.readback, held.dtype), held.tensors, what="held",
                   version=served.name)


def test_nan_weights_are_refused_and_the_served_version_stays(setup, make_client):
    chain, server = setup["chain"], setup["server"]
    loader = make_client(server, timeout=300, fallback_to_full=False)
    before = _served(server)
    poisoned = chain["writer"].add(nan_weights(chain["models"][1], setup["tmp"] / "nan", NORM), step=5)
    on = {"base_identity": chain["ids"][1]} if poisoned.kind == "delta" else {}
    with pytest.raises(HotLoadFailed, match="NaN"):
        loader.hot_load(poisoned.identity, **on)
    assert _served(server) == before


def test_the_default_dtype_serves_a_bfloat16_snapshot_verified_by_digest(tmp_path, make_client):
    """bfloat16 weights, vLLM at the CLI's default dtype: the versions hot-load, each verified by digest
    (what the loader read and the parameters in memory), and one left on the previous version is refused."""
    chain = _chain(tmp_path / "chain", dtype="bfloat16")
    fault = tmp_path / "fault.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faults.FAULT_ENV, str(fault))
        server = _gateway(chain, tmp_path / "work", _faulty(tmp_path).model_copy(update={"dtype": _cli_vllm_dtype()}))
    try:
        assert server.engine.engine_dtype == "bfloat16"
        loader = make_client(server, timeout=300, fallback_to_full=False)
        assert loader.hot_load(chain["ids"][0]).identity == chain["ids"][0]
        _arm(fault, mode="ignore")
        with pytest.raises(HotLoadFailed, match=EMBEDDINGS):
            loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0])
        assert loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0]).identity == chain["ids"][1]
        replica = server.engine.replicas[0]
        held = replica.client.read_held(replica.readback)
        assert held.dtype == "bfloat16" and held.identity == Path(server.engine.current().path).name
        assert EMBEDDINGS in held.tensors and all(t.finite for t in held.tensors.values())
        assert _served(server) == chain["ids"][1]
    finally:
        server.shutdown()
