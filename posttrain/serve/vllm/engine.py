"""The gateway's vLLM replicas (``posttrain serve --engine vllm``): servers it starts and
supervises, or servers at URLs someone else runs (``--engine-url``, one replica each)."""

from __future__ import annotations

import logging

from posttrain.serve.engine import EngineCallError
from posttrain.serve.holding import DEFAULT_FINGERPRINT_TOLERANCE, FINGERPRINT_TOLERANCE
from posttrain.serve.remote import RemoteEngine, Replica
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.vllm.client import VLLMClient
from posttrain.serve.vllm.process import READBACK_CLS, READBACK_MODULE, EngineStartError, VLLMProcess
from posttrain.serve.readback_extension import VERSION as READBACK_VERSION

log = logging.getLogger(__name__)


def open_vllm_engine(config: ServeConfig) -> RemoteEngine:
    """vLLM replicas for the gateway, each serving ``config.model_dir`` under the gateway's model name.

    vLLM's CPU build reloads a model with tied embeddings wrongly in place (the LM head keeps the
    old weights), so with ``reload: auto`` such a model is switched by restarting the engine. With
    ``vllm.max_lora_rank`` the replicas load LoRA adapters published alone at run time (replicas at
    URLs must run with --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and that rank)."""
    name = config.served_model_name or config.model_dir.resolve().name
    replicas: list[Replica] = []
    try:
        if config.engine_urls:
            for i, url in enumerate(config.engine_urls):
                replicas.append(Replica(f"vllm-{i}", _attach(i, url, name)))
        else:
            settings = config.vllm.model_copy(update={"served_model_name": name})
            for i in range(config.replicas):
                process = VLLMProcess(settings)
                if not process.python.is_file():  # a setting at fault: one line naming it, not a traceback
                    raise ValueError(f"vllm.python (--engine-python) {process.python}: no such file; give the "
                                     "Python of vLLM's venv (scripts/services/setup-vllm.sh makes one)")
                replicas.append(Replica(f"vllm-{i}", process.client(), process))
                log.info("starting vLLM replica %d of %d at %s", i + 1, config.replicas, process.url)
                try:
                    process.start(config.model_dir)
                except EngineStartError as e:  # its first lines say why (and the log's errors); the log holds the rest
                    raise ValueError(f"vLLM replica {i} did not start: {e.reason} (its log: {process.log_file})") from None
    except BaseException:
        for r in replicas:
            if r.process is not None:
                r.process.stop()
            else:
                r.client.close()
        raise
    # the dtype vLLM computes in, asked of vLLM: "auto" makes float32 weights half precision (vLLM's docs),
    # and a coarser dtype than the weights' widens the probe's and the fingerprint's tolerance
    dtype = _compute_dtype(replicas)
    return RemoteEngine(kind="vllm", model_dir=config.model_dir, model_name=name, replicas=replicas,
                        reload=config.reload, restart_when_tied=True, monitor_interval_s=config.probe_interval_s,
                        idle_interval_s=config.idle_probe_interval_s,
                        max_request_tokens=config.max_request_tokens, max_tokens_limit=config.max_tokens_limit,
                        max_n=config.max_n, max_lora_rank=config.vllm.max_lora_rank,
                        tolerance=FINGERPRINT_TOLERANCE.get(dtype, DEFAULT_FINGERPRINT_TOLERANCE), engine_dtype=dtype)


def _compute_dtype(replicas: list[Replica]) -> str:
    """The dtype every replica computes in, from its readback extension; ValueError when they differ."""
    dtypes = {r.name: str(r.client.readback_info().get("dtype")) for r in replicas}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"the vLLM replicas compute in different dtypes ({dtypes}): start them with one --dtype")
    return next(iter(dtypes.values()))


def _attach(i: int, url: str, name: str) -> VLLMClient:
    """A client of the vLLM server at ``engine_urls[i]``, which must answer now and serve ``name``."""
    client = VLLMClient(url)
    try:
        served = client.served_models()
    except EngineCallError as e:  # as SGLang's: one line naming the setting, not a traceback
        client.close()
        raise ValueError(f"engine_urls[{i}] (--engine-url) {url}: vLLM does not answer GET /v1/models "
                         f"({e})") from None
    if name not in served:
        client.close()
        raise ValueError(f"engine_urls[{i}] {url} serves {served}, not {name!r}: start it with "
                         f"--served-model-name {name}")
    try:
        info = client.readback_info()
    except EngineCallError as e:
        client.close()
        raise ValueError(
            f"engine_urls[{i}] (--engine-url) {url}: vLLM has no readback extension, so the gateway cannot read "
            f"back which weights it holds ({str(e)[:200]}): start it with --worker-extension-cls {READBACK_CLS} and "
            f"{READBACK_MODULE}.py (a copy of posttrain/serve/readback_extension.py) on its PYTHONPATH "
            "(docs/gateway.md; scripts/services/start-vllm.sh does both)") from None
    if info.get("version") != READBACK_VERSION:
        client.close()
        raise ValueError(f"engine_urls[{i}] (--engine-url) {url}: its readback extension is version "
                         f"{info.get('version')!r}, this gateway speaks {READBACK_VERSION}: copy this posttrain's "
                         "posttrain/serve/readback_extension.py again and restart it")
    return client
