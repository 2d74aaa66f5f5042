"""What the HTTP clients of engine servers (``vllm.client``, ``sglang``) share: one session, a
JSON request that raises the engine error types, and reading an engine's error text.

Errors: ``EngineCallError(status, message)`` when the server answers with a non-200 status (the
message is the server's own error text), ``EngineUnavailable`` (also a ``TransientError``) when it
does not answer at all (connection refused or reset, timeout).
"""

from __future__ import annotations

from typing import Any

import requests

from posttrain.serve.engine import EngineCallError, EngineUnavailable


def error_message(response: requests.Response) -> str:
    """An engine's error text: ``{"error": {"message": ...}}``, ``{"error": ...}``, ``{"message": ...}``,
    ``{"detail": ...}``, or the raw body."""
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
        if isinstance(body.get("message"), str):
            return body["message"]
        if "detail" in body:
            return str(body["detail"])
    return response.text[:2000]


class HTTPEngineClient:
    """Requests to the engine server at ``url`` (e.g. ``http://127.0.0.1:18000``), over one session."""

    def __init__(self, url: str, *, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._session = requests.Session()

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> HTTPEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> requests.Response:
        try:
            return self._session.request(method, self.url + path, timeout=timeout or self.timeout, **kw)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise EngineUnavailable(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from e

    def _drop_connections(self) -> None:
        """After an error answer: the server (uvicorn) may close that keep-alive connection without saying
        so, and the next request on it would fail with a reset, as if the server were down."""
        self._session.close()
        self._session = requests.Session()

    def _ok(self, method: str, path: str, **kw: Any) -> requests.Response:
        """The answer to a request, when it is 200; an ``EngineCallError`` with the server's message otherwise."""
        response = self._request(method, path, **kw)
        if response.status_code != 200:
            message = error_message(response)
            self._drop_connections()
            raise EngineCallError(response.status_code, f"{method} {path}: {message}")
        return response

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        response = self._ok(method, path, **kw)
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError as e:
            raise EngineCallError(response.status_code, f"{method} {path}: not JSON: {response.text[:500]!r}") from e

    def _text(self, method: str, path: str, **kw: Any) -> str:
        """A request whose 200 answer is plain text (vLLM's LoRA routes)."""
        return self._ok(method, path, **kw).text

    def _answers(self, path: str, timeout: float) -> bool:
        """True when ``GET path`` answers 200 within ``timeout``."""
        try:
            response = self._request("GET", path, timeout=timeout)
        except EngineUnavailable:
            return False
        if response.status_code != 200:
            self._drop_connections()
        return response.status_code == 200
