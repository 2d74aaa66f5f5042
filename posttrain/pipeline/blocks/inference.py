"""Block for an inference deployment that hot-loads snapshots and serves rollouts.

Two kinds of deployment speak what it needs (the hot-load v1alpha1 API and token-id
``/v1/completions`` whose replies carry ``snapshot_identity``):

- a CoreWeave inference deployment: ``api_url`` is CoreWeave's control plane, ``gateway_url`` the
  deployment's data plane;
- a ``posttrain serve`` gateway (``--engine vllm``, ``--engine sglang``, or the reference engine):
  one URL serves both, so ``api_url`` = ``gateway_url`` = the gateway's URL (the one it prints);
  ``deployment_id`` = its ``--deployment-id``; ``model`` = its ``--served-model-name``; ``token`` =
  its bearer token (what ``--token-env``/``--token-file`` give it). Its ``--store``/``--prefix`` must
  be where the run's ``ObjectStore`` block publishes, so it finds the snapshots it is asked to load.

Every reply names the snapshot that sampled it; the GRPO flow checks it against the one it
hot-loaded for the round, so a deployment another run hot-loads meanwhile fails the round's
shards instead of mislabelling their rollouts.
"""

from __future__ import annotations

from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr, field_validator

from posttrain import redact
from posttrain.polling import MIN_POLL_S


class InferenceDeployment(Block):
    """A deployment speaking CoreWeave's hot-load v1alpha1 contract and /v1/completions: a CoreWeave
    deployment, or a ``posttrain serve --engine vllm|sglang`` gateway (see the module docstring)."""

    _block_type_name: ClassVar[str] = "posttrain Inference Deployment"
    _block_type_slug: ClassVar[str] = "posttrain-inference-deployment"
    _description: ClassVar[str] = "Where posttrain hot-loads published snapshots and samples rollouts."
    _code_example: ClassVar[str] = """
A CoreWeave inference deployment:

```python
from posttrain.pipeline.blocks import InferenceDeployment

InferenceDeployment(gateway_url="https://my-gateway", deployment_id="dep-1", model="my-model",
                    token="...").save("prod")
```

A `posttrain serve` gateway in front of vLLM (or SGLang: `--engine sglang --engine-url ...`),
reading the store the pipeline publishes to, here `ObjectStore(uri="s3://checkpoints/training/run-001")`
(add `--s3-endpoint-url` for a non-AWS endpoint):

```bash
CW_API_TOKEN=... posttrain serve --engine vllm --model /models/base --served-model-name policy \\
    --deployment-id grpo-vllm --store s3://checkpoints --prefix training/run-001 --port 8000
```

```python
InferenceDeployment(api_url="http://gateway-host:8000", gateway_url="http://gateway-host:8000",
                    deployment_id="grpo-vllm", model="policy", token="...").save("vllm")
```
"""

    api_url: str = Field("https://api.coreweave.com", description="Hot-load control plane URL: CoreWeave's (the "
                         "default) for a CoreWeave deployment; for a posttrain serve gateway its own URL, = gateway_url.")
    gateway_url: str = Field(description="Data-plane URL serving /v1/completions.")
    deployment_id: str = Field(description="Id of the deployment to hot-load.")
    model: str = Field(description="Model name the deployment serves.")
    token: SecretStr = Field(description="Inference Admin token (CW_API_TOKEN), or a posttrain serve gateway's bearer token; never logged.")
    timeout_s: float = Field(1800.0, gt=0, description="Seconds one hot-load may take until replicas converge.")
    poll_interval_s: float = Field(2.0, ge=MIN_POLL_S, allow_inf_nan=False,
                                   description="Seconds between polls of a hot-load (at least 0.05).")
    fallback_to_full: bool = Field(True, description="Publish and load a full snapshot when a delta fails to load.")
    request_timeout_s: float = Field(120.0, gt=0, description="Seconds one completions request may take.")

    # an error about a URL must not echo it: it may hold a credential
    model_config = ConfigDict(hide_input_in_errors=True)

    @field_validator("api_url", "gateway_url")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return redact.no_credentials(value, "give it as token: {env: NAME} (the bearer token every call sends)")

    def hot_loader(self, publish_full=None):
        from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

        config = HotLoadConfig(api_url=self.api_url, deployment_id=self.deployment_id, token=self.token,
                               timeout=self.timeout_s, poll_interval=self.poll_interval_s,
                               fallback_to_full=self.fallback_to_full)
        return CoreWeaveHotLoader(config, publish_full=publish_full)

    def completions(self):
        from posttrain.rollouts.client import CompletionsClient, CompletionsConfig

        return CompletionsClient(CompletionsConfig(gateway_url=self.gateway_url, model=self.model, token=self.token,
                                                   timeout_s=self.request_timeout_s))
