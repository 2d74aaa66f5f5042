"""Configuration of ``posttrain serve``, the reference inference server, and its token."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from posttrain.polling import MIN_POLL_S
from posttrain.serve.faults import Fault
from posttrain.serve.vllm.process import VLLMProcessConfig


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: Path = Field(description="Boot weights: a Hugging Face causal LM folder (with its tokenizer).")
    served_model_name: str | None = Field(
        None, description="Name requests must give as `model` (default: the folder name)."
    )
    host: str = Field("127.0.0.1", description="Address to bind: a loopback one unless allow_remote.")
    allow_remote: bool = Field(
        False, description="Allow a host other than loopback (127.0.0.1, ::1, localhost): the server is then "
        "reachable from other machines, with only the bearer token and no TLS in front of it."
    )
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0: any free port).")
    deployment_id: str = Field(min_length=1, description="Id of the deployment this server is.")
    store: str = Field(description="Where the snapshot chain lives: a folder, file:// or s3:// URI.")
    prefix: str = Field("", description="Prefix inside the store; a snapshot is <prefix>/<identity>/<file>.")
    store_options: dict[str, Any] = Field(default_factory=dict, description="S3StoreConfig fields for s3:// stores.")
    token: SecretStr = Field(description="Bearer token every call must carry; never logged.")
    work_dir: Path | None = Field(
        None, description="Snapshot cache and reconstructed weights (default: a temporary folder, removed on exit)."
    )
    engine: Literal["reference", "vllm", "sglang"] = Field(
        "reference", description="What serves: reference (transformers in this process), vllm (vLLM servers "
        "behind this gateway) or sglang (SGLang servers someone else runs, behind this gateway)."
    )
    engine_urls: list[str] = Field(
        default_factory=list, description="vllm: URLs of vLLM servers someone else runs, one replica each; "
        "without any, the gateway starts `replicas` vLLM servers itself and restarts one that dies. sglang "
        "(required): URLs of SGLang servers someone else runs, one replica each; they must read the gateway's "
        "work_dir at the same paths."
    )
    vllm: VLLMProcessConfig = Field(
        default_factory=VLLMProcessConfig, description="vllm: how the gateway runs the vLLM servers it starts "
        "(its Python, dtype, lengths, extra arguments); the served name is the gateway's."
    )
    reload: Literal["auto", "in-place", "restart"] = Field(
        "auto", description="vllm: how a replica takes new weights: in place (pause, reload_weights, resume), by "
        "restarting the engine on the new folder, or auto (restart where in place cannot be trusted: tied "
        "embeddings)."
    )
    replicas: int = Field(
        1, ge=1, le=10_000, description="Replicas reported by the hot-load API (reference: one model serves all; "
        "vllm: engines the gateway starts)."
    )
    device: str = Field("auto", description="torch device: auto (cuda when available), cpu, cuda, cuda:1 ...")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_n: int = Field(64, ge=1, description="Largest n a request may ask for.")
    max_request_tokens: int = Field(
        262_144, ge=1, description="Largest n x (prompt + max_tokens) tokens, summed over the prompts, one "
        "completions request may ask for (every engine: what the engine holds and what a gateway builds): a "
        "request over it is refused with a 400 naming this limit, so that none holds the engine or the gateway's "
        "memory for long."
    )
    probe_interval_s: float = Field(
        2.0, ge=MIN_POLL_S, le=3600, description="Seconds (at least 0.05) between two health probes of each replica; "
        "each reads back what the replica holds (digests of its weights, its weight version, its answers to a "
        "fixed prompt), so a replica on other weights is put back or reported ERROR within one interval."
    )
    idle_probe_interval_s: float | None = Field(
        60.0, ge=MIN_POLL_S, le=86400, description="Seconds between two readbacks of a replica of an engine behind "
        "the gateway (vLLM, SGLang) that answered no request since its last one; it is still asked /health every "
        "probe_interval_s. A readback sends the engine's worker a request, and vLLM's worker then spins a second "
        "waiting for the next: read back every 2 s, an idle replica kept half a core busy. A replica that answered "
        "requests is read back at the next probe. None: every probe_interval_s."
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Serve /metrics (Prometheus) on this port of host (0: any free port) "
        "instead of the main one; there it needs no token when host is loopback or metrics_no_auth is set, "
        "else the same bearer token. None: /metrics on the main port, behind the token like every route."
    )
    metrics_no_auth: bool = Field(
        False, description="/metrics on metrics_port without the token even when host is not loopback (for a "
        "network where only Prometheus reaches that port)."
    )
    max_batch_rows: int = Field(64, ge=1, description="Sequences sampled together in one batch.")
    test_hooks: bool = Field(False, description="Serve /_test/faults and /_test/stats (fault injection). Tests only.")
    faults: list[Fault] = Field(default_factory=list, description="Faults armed at start (implies test hooks).")

    @model_validator(mode="after")
    def _engine_settings(self) -> ServeConfig:
        if self.engine == "reference":
            for name in ("engine_urls", "vllm"):
                if name in self.model_fields_set:
                    raise ValueError(f"{name} is for --engine vllm; the reference engine serves in this process")
        if self.engine == "sglang":
            if not self.engine_urls:
                raise ValueError("engine sglang needs engine_urls (--engine-url): the SGLang servers to put the "
                                 "gateway in front of; the gateway does not start SGLang")
            if "vllm" in self.model_fields_set:
                raise ValueError("vllm is for --engine vllm, not sglang")
            if self.reload == "restart":
                raise ValueError("reload restart needs an engine the gateway starts; with sglang use auto or "
                                 "in-place")
        if self.engine == "vllm" and self.engine_urls and self.reload == "restart":
            raise ValueError("reload restart needs engines the gateway starts; vLLM servers at engine_urls "
                             "(--engine-url) are someone else's to restart: use auto or in-place")
        if not self.allow_remote and not _loopback(self.host):
            raise ValueError(f"host {self.host!r} is not a loopback address: the server would be reachable from "
                             "other machines; give allow_remote (--allow-remote) to mean it")
        if self.metrics_no_auth and self.metrics_port is None:
            raise ValueError("metrics_no_auth (--metrics-no-auth) is for a separate metrics_port (--metrics-port); "
                             "on the main port /metrics needs the token like every route")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port (--metrics-port) {self.metrics_port} is the main port (--port); give "
                             "another one, or none for /metrics on the main port")
        for i, url in enumerate(self.engine_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_urls[{i}]: {url!r} is not an http(s) URL")
        return self


def metrics_need_token(config: ServeConfig) -> bool:
    """Whether /metrics needs the bearer token: always on the main port; on metrics_port unless the
    server binds loopback only or metrics_no_auth says so."""
    return config.metrics_port is None or not (config.metrics_no_auth or _loopback(config.host))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(*, env: str | None = None, file: str | os.PathLike[str] | None = None) -> SecretStr:
    """The token from a file (first line) or an environment variable; the error never shows it."""
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"cannot read the token file {file}: {e.strerror}") from None
        if not text:
            raise ValueError(f"the token file {file} is empty")
        return SecretStr(text.splitlines()[0].strip())
    if env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ValueError(f"environment variable {env} (the API token) is not set")
        return SecretStr(value)
    raise ValueError("give the API token through an environment variable or a file")
