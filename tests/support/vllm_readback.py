"""The gateway over REAL vLLM with the test's faulty readback extension: shared by the readback tests
(tests/serve/vllm/test_vllm_readback*.py, one module per set of engines alive at once: an engine whose
gateway probes it keeps vLLM's worker busy on the core a second engine's worker is pinned to)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from posttrain.chain.policy import ChainPolicy
from posttrain.chain.writer import ChainWriter
from posttrain.cli.serve import register as register_serve
from posttrain.serve.server import InferenceServer
from posttrain.serve.vllm.process import VLLMProcessConfig
from posttrain.testing import vllm_readback_faults as faults
from tests.support.serving import PREFIX, Api
from tests.support.updates import one_update
from tests.support.vllm import BF16_SHAPE, served_greedy, vllm_model
from tests.support.vllm_gateway import vllm_gateway

EMBEDDINGS = "model.embed_tokens.weight"


def readback_chain(root: Path, dtype: str = "float32") -> dict:
    """A boot model and the same model after one AdamW step at lr 1e-6 (``dtype``: how both are saved),
    of a shape vLLM serves at the default dtype too (bfloat16 attention, ``BF16_SHAPE``)."""
    m0 = vllm_model(root / "m0", shape=BF16_SHAPE)
    if dtype != "float32":
        m0 = one_update(m0, root / f"m0-{dtype}", lr=0.0, dtype=dtype)  # the boot weights in that dtype
    m1 = one_update(m0, root / "m1", lr=1e-6, dtype=dtype)
    writer = ChainWriter(root / "store" / PREFIX, run="r", policy=ChainPolicy(delta_budget=100.0))
    snaps = [writer.add(m0, step=0), writer.add(m1, base=m0, step=1)]
    return {
        "models": [m0, m1],
        "ids": [s.identity for s in snaps],
        "store": root / "store",
        "writer": writer,
        "root": root,
    }


def faulty_vllm(tmp: Path) -> VLLMProcessConfig:
    """vLLM settings that load the test's faulty readback extension (beside the real one)."""
    folder = tmp / "ext"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(faults.__file__, folder / f"{faults.MODULE}.py")
    return VLLMProcessConfig(worker_extension=faults.CLS, extension_path=[folder], log_file=tmp / "vllm.log")


def cli_vllm_dtype() -> str:
    """The dtype `posttrain serve --engine vllm` gives vLLM when none is named."""
    import argparse

    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--engine", "vllm", "--model", "m", "--deployment-id", "d", "--store", "s"])
    return args.engine_dtype


def readback_gateway(chain: dict, work: Path, vllm: VLLMProcessConfig) -> InferenceServer:
    # an idle replica read back every 2 s: found within 2.5 s
    return vllm_gateway(
        chain,
        work,
        vllm=vllm.model_copy(update={"served_model_name": "tiny"}),
        probe_interval_s=0.5,
        idle_probe_interval_s=2.0,
    )


def arm_fault(path: Path, **fault) -> None:
    """The next in-place reload misbehaves as ``fault`` says (``posttrain.testing.vllm_readback_faults``)."""
    path.write_text(json.dumps(fault))


def served_identity(server) -> str | None:
    return served_greedy(Api(server.url))[1]
