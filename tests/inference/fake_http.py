"""A scripted stand-in for ``requests.Session``: replies (or raises) in order and records every call."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import requests


def reply(status: int, body: object = None, *, text: str | None = None, headers: dict | None = None
          ) -> requests.Response:
    """A ``requests.Response`` with a JSON ``body`` (or raw ``text``)."""
    r = requests.Response()
    r.status_code = status
    r.reason = "Reason"
    r._content = (text if text is not None else json.dumps(body)).encode()
    r.headers.update(headers or {})
    return r


@dataclass
class FakeSession:
    script: list = field(default_factory=list)  # Responses to return, exceptions to raise
    calls: list[dict] = field(default_factory=list)
    closed: bool = False

    def request(self, method: str, url: str, **kw) -> requests.Response:
        self.calls.append({"method": method, "url": url, **kw})
        if not self.script:
            raise AssertionError(f"unexpected call: {method} {url}")
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.closed = True
