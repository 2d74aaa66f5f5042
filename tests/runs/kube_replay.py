"""A recorded Kubernetes API: an HTTP server on 127.0.0.1 that answers with kube-apiserver responses
stored under ``tests/runs/recorded/k8s/`` and records every request it received.

Each recording is one exchange: ``{"request": "METHOD /path?query", "status": ..., "body": ...}``.
``answer(*names)`` queues recordings; a request is answered by the first queued recording for its
method and path (query included), and the last one for a method and path keeps answering. A request
nothing was queued for gets the server's own 404 for an unknown path and is kept in ``unexpected``.
The real ``kubernetes`` client reaches it through ``kubeconfig(...)``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

RECORDED = Path(__file__).resolve().parent / "recorded" / "k8s"
TOKEN = "recorded-api-token"
# What kube-apiserver answers for a path it does not serve.
UNKNOWN_PATH = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "the server could not find the requested resource", "reason": "NotFound",
                "details": {}, "code": 404}


@dataclass
class Received:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any  # the JSON body, None without one
    authorization: str | None

    @property
    def line(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class RecordedKubeApi:
    queued: dict[str, list[dict]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    unexpected: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, *names: str) -> None:
        """Queue the recordings ``<name>.json``, in order."""
        for name in names:
            recording = json.loads((RECORDED / f"{name}.json").read_text())
            self.queued.setdefault(recording["request"], []).append(recording)

    def reply(self, method: str, target: str) -> tuple[int, dict] | None:
        with self.lock:
            queue = self.queued.get(f"{method} {target}")
            if not queue:
                return None
            recording = queue.pop(0) if len(queue) > 1 else queue[0]
            return recording["status"], recording["body"]

    def serve(self) -> tuple[ThreadingHTTPServer, threading.Thread]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                url = urlsplit(self.path)
                got = Received(self.command, url.path, parse_qs(url.query), json.loads(raw) if raw else None,
                               self.headers.get("Authorization"))
                api.received.append(got)
                answer = api.reply(self.command, self.path)
                if answer is None:
                    api.unexpected.append(got)
                    answer = (404, UNKNOWN_PATH)
                status, body = answer
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_DELETE = do_POST = do_PATCH = do_PUT = _handle

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, name="recorded-kube-api", daemon=True)
        thread.start()
        return server, thread


def kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig whose current context is the recorded API at ``url``, with a bearer token."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "recorded", "cluster": {"server": url}}],
        "users": [{"name": "recorded", "user": {"token": TOKEN}}],
        "contexts": [{"name": "recorded", "context": {"cluster": "recorded", "user": "recorded",
                                                      "namespace": "ml-team"}}],
        "current-context": "recorded",
    }))
    return path
