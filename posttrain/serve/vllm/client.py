"""A small HTTP client for one vLLM OpenAI-compatible server (``vllm.entrypoints``, CPU or GPU).

It speaks the endpoints the gateway needs: ``/health``, ``/v1/models``, ``/v1/completions`` and
the dev-mode weight reload (``/pause?mode=wait``, ``/collective_rpc`` with ``reload_weights``,
``/resume``; the server must run with ``VLLM_SERVER_DEV_MODE=1``, on loopback only).

Errors: ``EngineCallError(status, message)`` when vLLM answers with a non-200 status (the message
is vLLM's own error text), ``EngineUnavailable`` (also a ``TransientError``) when it does not
answer at all (connection refused or reset, timeout).

A failed reload (a wrong shape, a nonexistent path) leaves vLLM broken while ``/health`` still
answers 200 and ``/resume`` works: the next generate request fails with 500 and kills the engine
(``/health`` 503, then the server exits). Restart the server after one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import requests

from posttrain.serve.engine import EngineCallError, EngineUnavailable


# Asked of every completion: RL needs the sampled token ids, never text to tokenize again.
TOKEN_IDS = {"return_token_ids": True, "return_tokens_as_token_ids": True}


def _error_message(response: requests.Response) -> str:
    """vLLM's error text: ``{"error": {"message": ...}}``, ``{"detail": ...}``, or the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000] or response.reason or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in body:
            return str(body["detail"])
    return response.text[:2000]


class VLLMClient:
    """Requests to the vLLM server at ``url`` (e.g. ``http://127.0.0.1:18000``), over one session."""

    def __init__(self, url: str, *, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._session = requests.Session()

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> VLLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> requests.Response:
        try:
            return self._session.request(method, self.url + path, timeout=timeout or self.timeout, **kw)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise EngineUnavailable(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from e

    def _drop_connections(self) -> None:
        """After an error answer: vLLM (uvicorn) may close that keep-alive connection without saying so,
        and the next request on it would fail with a reset, as if vLLM were down."""
        self._session.close()
        self._session = requests.Session()

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        response = self._request(method, path, **kw)
        if response.status_code != 200:
            message = _error_message(response)
            self._drop_connections()
            raise EngineCallError(response.status_code, f"{method} {path}: {message}")
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError as e:
            raise EngineCallError(response.status_code, f"{method} {path}: not JSON: {response.text[:500]!r}") from e

    def health(self, *, timeout: float = 5.0) -> bool:
        """True when ``GET /health`` answers 200 (it does even after a failed reload, see the module doc)."""
        try:
            response = self._request("GET", "/health", timeout=timeout)
        except EngineUnavailable:
            return False
        if response.status_code != 200:
            self._drop_connections()
        return response.status_code == 200

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

    def reload(self, folder: Path) -> None:
        """Load the weights in ``folder`` in place (between ``pause`` and ``resume``).

        vLLM reads the folder itself, so it must be a path on vLLM's machine. It does not check
        the tensors: a missing one keeps its old value silently; a wrong shape or a nonexistent
        path raises ``EngineCallError`` and leaves the engine broken (restart it).
        """
        payload = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        self._json("POST", "/collective_rpc", json=payload)

    def resume(self) -> None:
        """Take requests again (``POST /resume``)."""
        self._json("POST", "/resume")


__all__ = ["VLLMClient"]
