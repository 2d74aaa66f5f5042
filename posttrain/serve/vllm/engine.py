"""The gateway's vLLM replicas (``posttrain serve --engine vllm``): servers it starts and
supervises, or servers at URLs someone else runs (``--engine-url``, one replica each)."""

from __future__ import annotations

import logging

from posttrain.serve.engine import EngineCallError
from posttrain.serve.holding import DEFAULT_FINGERPRINT_TOLERANCE, FINGERPRINT_TOLERANCE
from posttrain.serve.remote import RemoteEngine, Replica
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.vllm.client import VLLMClient
from posttrain.serve.vllm.process import EngineStartError, VLLMProcess

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
                except EngineStartError as e:  # its first line says why; the log file holds the rest
                    raise ValueError(f"vLLM replica {i} did not start: {str(e).splitlines()[0]} "
                                     f"(its log: {process.log_file})") from None
    except BaseException:
        for r in replicas:
            if r.process is not None:
                r.process.stop()
            else:
                r.client.close()
        raise
    return RemoteEngine(kind="vllm", model_dir=config.model_dir, model_name=name, replicas=replicas,
                        reload=config.reload, restart_when_tied=True, monitor_interval_s=config.probe_interval_s,
                        max_request_tokens=config.max_request_tokens, max_tokens_limit=config.max_tokens_limit,
                        max_n=config.max_n, max_lora_rank=config.vllm.max_lora_rank,
                        tolerance=FINGERPRINT_TOLERANCE.get(config.vllm.dtype, DEFAULT_FINGERPRINT_TOLERANCE),
                        engine_dtype=None if config.vllm.dtype == "auto" else config.vllm.dtype)


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
    return client
