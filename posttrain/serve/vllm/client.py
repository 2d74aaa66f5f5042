"""A small HTTP client for one vLLM OpenAI-compatible server (``vllm.entrypoints``, CPU or GPU).

It speaks the endpoints the gateway needs: ``/health``, ``/v1/models``, ``/v1/completions`` and
runtime LoRA adapters (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; the server
must run with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), and the dev-mode
weight reload (``/pause?mode=wait``, ``/collective_rpc`` calling the readback extension's ``posttrain_reload``,
``/reset_prefix_cache``, ``/resume``; the server must run with ``VLLM_SERVER_DEV_MODE=1``, on loopback only).

Errors as every engine client's (``http_client``): ``EngineCallError(status, message)`` when vLLM
answers with a non-200 status (vLLM's own error text), ``EngineUnavailable`` when it does not answer.

A failed reload (a wrong shape, a nonexistent path) leaves vLLM broken while ``/health`` still
answers 200 and ``/resume`` works: the next generate request fails with 500 and kills the engine
(``/health`` 503, then the server exits). Restart the server after one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.serve.engine import EngineCallError
from posttrain.serve.http_client import HTTPEngineClient
from posttrain.serve.weight_digest import HeldReport, HeldTensor, parse_wire

# Asked of every completion: RL needs the sampled token ids, never text to tokenize again.
TOKEN_IDS = {"return_token_ids": True, "return_tokens_as_token_ids": True}


class VLLMClient(HTTPEngineClient):
    """Requests to the vLLM server at ``url`` (e.g. ``http://127.0.0.1:18000``), over one session."""

    def health(self, *, timeout: float = 5.0) -> bool:
        """True when ``GET /health`` answers 200 (it does even after a failed reload, see the module doc)."""
        return self._answers("/health", timeout)

    def served_models(self) -> list[str]:
        """The model names requests may give (``GET /v1/models``)."""
        body = self._json("GET", "/v1/models")
        return [m["id"] for m in body.get("data", [])]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions``; the answer carries token ids (``choices[i].token_ids``, and
        ``logprobs.tokens`` as ``token_id:N``) unless ``body`` says otherwise."""
        return self._json("POST", "/v1/completions", json={**TOKEN_IDS, **body})

    def pause(self) -> None:
        """Stop taking new requests once in-flight ones finish (``POST /pause?mode=wait``)."""
        body = self._json("POST", "/pause", params={"mode": "wait"})
        if body.get("status") != "paused":
            raise EngineCallError(200, f"POST /pause?mode=wait: expected status 'paused', got {body!r}")

    def reload(self, folder: Path) -> dict[str, HeldTensor]:
        """Load the weights in ``folder`` in place (between ``pause`` and ``resume``); the digests of the
        tensors vLLM's loader handed to the model (the readback extension, ``readback_extension``).

        vLLM reads the folder itself, so it must be a path on vLLM's machine. It does not check
        the tensors: a missing one keeps its old value silently (the digests show it); a wrong shape
        or a nonexistent path raises ``EngineCallError`` and leaves the engine broken (restart it).
        """
        result = self._rpc("posttrain_reload", weights_path=str(folder), identity=folder.name)
        consumed = parse_wire(result.get("consumed"), f"{self.url}: posttrain_reload")
        # KV blocks cached under the old weights must not answer a prompt under the new ones (every
        # cache policy: a mix of two versions corrupts RL). /pause clears them too, but that flag is
        # deprecated; this says so explicitly, and is checked.
        reset = self._json("POST", "/reset_prefix_cache")
        if not (isinstance(reset, dict) and reset.get("success") is True):
            raise EngineCallError(200, f"POST /reset_prefix_cache: the prefix cache was not reset ({reset!r})")
        return consumed

    def readback_info(self) -> dict:
        """``{"version": n, "dtype": d}`` from the readback extension: that it is loaded, and the dtype
        vLLM computes in (what ``--dtype auto`` became)."""
        return self._rpc("posttrain_version")

    def read_layout(self, candidates: list[str]) -> dict[str, HeldTensor]:
        """Every parameter vLLM holds (name, dtype, shape; no digest): ``candidates`` are not needed here."""
        return parse_wire(self._rpc("posttrain_held", names="{}").get("tensors"), f"{self.url}: posttrain_held")

    def read_held(self, names: Mapping[str, int | None]) -> HeldReport:
        """Digests of ``names`` as vLLM's worker holds them now, and the identity of its last verified reload."""
        result = self._rpc("posttrain_held", names=json.dumps(dict(names)))
        return HeldReport(parse_wire(result.get("tensors"), f"{self.url}: posttrain_held"),
                          result.get("identity"), str(result.get("dtype")))

    def _rpc(self, method: str, **kwargs: str) -> dict:
        """Call ``method`` of the readback extension in vLLM's worker (``POST /collective_rpc``): the one
        worker's answer. vLLM without the extension answers 500 naming the method."""
        body = self._json("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs})
        results = body.get("results") if isinstance(body, dict) else None
        if not (isinstance(results, list) and len(results) == 1 and isinstance(results[0], dict)):
            raise EngineCallError(200, f"POST /collective_rpc {method}: expected one worker's answer, got {body!r}")
        return results[0]

    def resume(self) -> None:
        """Take requests again (``POST /resume``)."""
        self._json("POST", "/resume")

    def load_adapter(self, name: str, folder: Path) -> None:
        """Load the peft adapter in ``folder`` as model ``name`` (``POST /v1/load_lora_adapter``); the
        server must run with LoRA on. vLLM checks the folder first: a bad one (missing, a rank over
        --max-lora-rank) is an ``EngineCallError`` and leaves what it served unchanged."""
        self._text("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (``POST /v1/unload_lora_adapter``)."""
        self._text("POST", "/v1/unload_lora_adapter", json={"lora_name": name})


__all__ = ["VLLMClient"]
