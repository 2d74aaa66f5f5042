"""vLLM as the serving engine (``posttrain serve --engine vllm``), reached over HTTP only.

``client`` (``VLLMClient``: health, models, completions, pause/reload/resume of weights) and
``process`` (``VLLMProcess``: start, supervise, restart and stop one vLLM server on loopback
from vLLM's own venv, see ``scripts/services/setup-vllm.sh``). Plain Python: no Prefect, no torch.
"""

from posttrain.serve.vllm.client import EngineError, EngineUnavailable, VLLMClient
from posttrain.serve.vllm.process import EngineStartError, VLLMProcess, VLLMProcessConfig

__all__ = ["EngineError", "EngineStartError", "EngineUnavailable", "VLLMClient", "VLLMProcess", "VLLMProcessConfig"]
