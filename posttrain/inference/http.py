"""The retrying HTTP layer of the hot-load client: one JSON call to the control plane at a time.

``HotLoadHTTP`` sends the bearer token in the Authorization header (and nowhere else), retries
connection errors, timeouts, 429 and 5xx with jittered exponential backoff that honours
Retry-After, never waits past a caller's deadline, decodes error bodies whatever their shape,
and scrubs the token from every message it builds from a server reply.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable
from typing import Any

import requests

from posttrain import redact
from posttrain.inference.config import HotLoadConfig
from posttrain.inference.contract import HotLoadAPIError, HotLoadUnavailable

log = redact.logger(__name__)  # every record scrubbed (S3 credentials, URL userinfo)


class HotLoadHTTP:
    """JSON calls to ``config.api_url`` with retries; counts the calls it repeated in ``retries``."""

    def __init__(
        self,
        config: HotLoadConfig,
        *,
        session: requests.Session | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.session = session or requests.Session()
        self.sleep = sleep
        self.clock = clock
        self.retries = 0
        self.deadline: float | None = None  # a ``clock`` reading no call retries past (the hot-load's own)

    def close(self) -> None:
        self.session.close()

    def request(self, name: str, method: str, path: str, *, params: dict | None = None,
                json: dict | None = None, retry: bool = True, not_found_ok: bool = False) -> Any:
        """The JSON object the call ``name`` returns; None for a 404 when ``not_found_ok``.

        Raises HotLoadUnavailable on a connection error, timeout, 429 or 5xx (at once when
        ``retry`` is False, else once ``max_attempts`` tries failed so), HotLoadAPIError on any
        other HTTP error or a reply that is not a JSON object.
        """
        url = self.config.api_url + path
        headers = {"Authorization": f"Bearer {self.config.token.get_secret_value()}", "Accept": "application/json"}
        where = self._where(name, method, path)
        # no retry waits past the hot-load's deadline, nor past config.timeout for a call made alone
        deadline = self.clock() + self.config.timeout
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = self.session.request(method, url, params=params, json=json, headers=headers,
                                            timeout=self.config.request_timeout, allow_redirects=False)
            except (requests.ConnectionError, requests.Timeout) as e:
                # requests' exceptions carry the prepared request (and its header): never chain them
                problem = HotLoadUnavailable(f"{where}: {type(e).__name__}: {self.scrub(_short(e))}")
            else:
                status = resp.status_code
                if status == 404 and not_found_ok:
                    return None
                if status == 429 or status >= 500:
                    code, message = _error_of(resp)
                    problem = HotLoadUnavailable(self.scrub(f"{where}: HTTP {status}: {message}"), status=status,
                                                 code=code, retry_after=_retry_after(resp.headers.get("Retry-After")))
                elif status >= 400:
                    code, message = _error_of(resp)
                    raise HotLoadAPIError(self.scrub(f"{where} failed: HTTP {status}: {message}"),
                                          status=status, code=code)
                else:
                    return _json_object(resp, where)
            if not retry:
                raise problem
            if attempt >= self.config.max_attempts:
                raise HotLoadUnavailable(f"{problem} (gave up after {attempt} attempts)", status=problem.status,
                                         code=problem.code) from None
            if self.clock() >= deadline:
                raise HotLoadUnavailable(f"{problem} (gave up after {attempt} attempts: the client's deadline of "
                                         f"{self.config.timeout:.0f}s passed)", status=problem.status,
                                         code=problem.code) from None
            self.backoff(attempt, problem.retry_after, deadline, str(problem))

    def pages(self, name: str, path: str, key: str, params: dict[str, Any]) -> list[dict]:
        """The objects listed under ``key`` on every page of GET ``path`` (pageToken / nextPageToken)."""
        where = self._where(name, "GET", path)
        out: list[dict] = []
        token, seen = "", set()
        while True:
            body = self.request(name, "GET", path, params={**params, "pageToken": token} if token else params)
            items = body.get(key) or []
            if not isinstance(items, list):
                raise HotLoadAPIError(f"{where}: {key} is not a list")
            out += [item for item in items if isinstance(item, dict)]
            token = body.get("nextPageToken") or ""
            if not token:
                return out
            if token in seen:
                raise HotLoadAPIError(f"{where}: the service repeated a page token")
            seen.add(token)

    def _where(self, name: str, method: str, path: str) -> str:
        return f"{name} ({method} {path}) for deployment {self.config.deployment_id}"

    def backoff(self, attempt: int, retry_after: float | None, deadline: float | None, why: str) -> None:
        """Wait before try ``attempt + 1``: exponential with jitter, at least Retry-After, never past ``deadline``."""
        delay = min(self.config.backoff_max, self.config.backoff_base * 2 ** (attempt - 1))
        delay *= 0.5 + random.random() / 2  # jitter: several clients do not retry in step
        if retry_after is not None:
            delay = max(delay, retry_after)
        if deadline is not None:  # a Retry-After of an hour waits until the deadline at most
            delay = max(0.0, min(delay, deadline - self.clock()))
        self.retries += 1
        log.warning("%s; retrying in %.1fs", why, delay)
        self.pause(delay, deadline)

    def pause(self, seconds: float, deadline: float | None) -> None:
        """Sleep ``seconds``, or until ``deadline`` (a ``clock`` reading) when that comes first."""
        if deadline is not None:
            seconds = max(0.0, min(seconds, deadline - self.clock()))
        if seconds > 0:
            self.sleep(seconds)

    def scrub(self, text: str) -> str:
        """``text`` with the token, S3 credentials and URL userinfo replaced by ``***`` (a failed
        hot-load's condition may quote the store's error)."""
        secret = self.config.token.get_secret_value()
        return redact.scrub(text.replace(secret, "***") if secret else text)


def _json_object(resp: requests.Response, where: str) -> dict:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise HotLoadAPIError(f"{where}: the reply is not a JSON object (HTTP {resp.status_code})",
                              status=resp.status_code)
    return body


def _error_of(resp: requests.Response) -> tuple[int | None, str]:
    """(gRPC code, message) of an error reply, whatever its shape."""
    try:
        body = resp.json()
    except ValueError:
        return None, (resp.text or resp.reason or "").strip()[:300]
    if isinstance(body, dict):
        err = body.get("error") if isinstance(body.get("error"), dict) else body
        code = err.get("code")
        message = err.get("message") or err.get("detail") or ""
        return (code if isinstance(code, int) else None), str(message)[:500]
    return None, str(body)[:300]


def _retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); None when absent or
    unreadable (``inf``, ``nan``, negative, garbage: the client's own backoff applies)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value) if len(value) <= 12 else None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # not the header's form (digits only), but meant as seconds: taken when finite and not negative
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError, IndexError):
        return None


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) < 300 else text[:300] + "..."


__all__ = ["HotLoadHTTP"]
