"""bfloat16 weights served by REAL vLLM at the CLI's default dtype, each version verified by digest: a module of
its own, so that no other gateway's engine is alive while this one starts (see tests/support/vllm_readback.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.inference.contract import HotLoadFailed
from posttrain.testing import vllm_readback_faults as faults
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


def test_the_default_dtype_serves_a_bfloat16_snapshot_verified_by_digest(tmp_path, make_client):
    """bfloat16 weights, vLLM at the CLI's default dtype: the versions hot-load, each verified by digest
    (what the loader read and the parameters in memory), and one left on the previous version is refused."""
    chain = readback_chain(tmp_path / "chain", dtype="bfloat16")
    fault = tmp_path / "fault.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faults.FAULT_ENV, str(fault))
        server = readback_gateway(
            chain, tmp_path / "work", faulty_vllm(tmp_path).model_copy(update={"dtype": cli_vllm_dtype()})
        )
    try:
        assert server.engine.engine_dtype == "bfloat16"
        loader = make_client(server, timeout=300, fallback_to_full=False)
        assert loader.hot_load(chain["ids"][0]).identity == chain["ids"][0]
        arm_fault(fault, mode="ignore")
        with pytest.raises(HotLoadFailed, match=EMBEDDINGS):
            loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0])
        assert loader.hot_load(chain["ids"][1], base_identity=chain["ids"][0]).identity == chain["ids"][1]
        replica = server.engine.replicas[0]
        held = replica.client.read_held(replica.readback)
        assert held.dtype == "bfloat16" and held.identity == Path(server.engine.current().path).name
        assert EMBEDDINGS in held.tensors and all(t.finite for t in held.tensors.values())
        assert served_identity(server) == chain["ids"][1]
    finally:
        server.shutdown()
