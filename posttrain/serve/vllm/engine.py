"""The gateway's vLLM replicas (``posttrain serve --engine vllm``): servers it starts and
supervises, or servers at URLs someone else runs (``--engine-url``, one replica each)."""

from __future__ import annotations

import logging

from posttrain.serve.holding import DEFAULT_FINGERPRINT_TOLERANCE, FINGERPRINT_TOLERANCE
from posttrain.serve.remote import RemoteEngine, Replica
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.vllm.client import VLLMClient
from posttrain.serve.vllm.process import VLLMProcess

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
                client = VLLMClient(url)
                served = client.served_models()
                if name not in served:
                    raise ValueError(f"engine_urls[{i}] {url} serves {served}, not {name!r}: start it with "
                                     f"--served-model-name {name}")
                replicas.append(Replica(f"vllm-{i}", client))
        else:
            settings = config.vllm.model_copy(update={"served_model_name": name})
            for i in range(config.replicas):
                process = VLLMProcess(settings)
                replicas.append(Replica(f"vllm-{i}", process.client(), process))
                log.info("starting vLLM replica %d of %d at %s", i + 1, config.replicas, process.url)
                process.start(config.model_dir)
    except BaseException:
        for r in replicas:
            if r.process is not None:
                r.process.stop()
        raise
    return RemoteEngine(kind="vllm", model_dir=config.model_dir, model_name=name, replicas=replicas,
                        reload=config.reload, restart_when_tied=True, monitor_interval_s=config.probe_interval_s,
                        max_request_tokens=config.max_request_tokens, max_tokens_limit=config.max_tokens_limit,
                        max_n=config.max_n, max_lora_rank=config.vllm.max_lora_rank,
                        tolerance=FINGERPRINT_TOLERANCE.get(config.vllm.dtype, DEFAULT_FINGERPRINT_TOLERANCE))
