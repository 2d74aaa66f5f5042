"""vLLM as the serving engine (``posttrain serve --engine vllm``), reached over HTTP only.

``engine`` (``open_vllm_engine``: the gateway's replicas, started here or at given URLs),
``client`` (``VLLMClient``: health, models, completions, pause/reload/resume of weights) and
``process`` (``VLLMProcess``: start, supervise, restart and stop one vLLM server on loopback
from vLLM's own venv, see ``scripts/services/setup-vllm.sh``). Plain Python: no Prefect, no torch.
"""

from posttrain.serve.vllm.client import VLLMClient
from posttrain.serve.vllm.process import EngineStartError, VLLMProcess, VLLMProcessConfig

__all__ = ["EngineStartError", "VLLMClient", "VLLMProcess", "VLLMProcessConfig"]
