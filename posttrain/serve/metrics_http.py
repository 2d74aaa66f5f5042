"""The metrics port of ``posttrain serve`` (``--metrics-port``): ``GET /metrics`` only, with the bearer
token unless the server binds loopback only or ``--metrics-no-auth`` says so (docs/metrics.md)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol
from urllib.parse import urlsplit

from posttrain import redact
from posttrain.serve.metrics import CONTENT_TYPE, ServeMetrics
from posttrain.serve.serve_config import ServeConfig, metrics_need_token

log = redact.logger(__name__)


class MetricsApp(Protocol):
    """What the metrics port serves from: the server (``InferenceServer``), which opens this port. A
    protocol, so that this module does not import the server back."""

    config: ServeConfig
    metrics: ServeMetrics

    def authorized(self, header: str | None) -> bool: ...


class MetricsPort:
    """The metrics port's server: bound at once (``error`` naming the port when it cannot be), listening
    from ``activate``, served from ``start`` in a thread of its own."""

    def __init__(self, app: MetricsApp, host: str, port: int, error: type[Exception]):
        class Handler(_MetricsHandler):
            pass

        Handler.app = app
        self.httpd = ThreadingHTTPServer((host, port), Handler, bind_and_activate=False)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        try:
            self.httpd.server_bind()
        except OSError as e:
            self.httpd.server_close()
            raise error(f"metrics port {port} (--metrics-port): cannot listen on {host}:{port}: "
                        f"{e.strerror or e}") from None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def activate(self) -> None:
        self.httpd.server_activate()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                            name="posttrain-metrics", daemon=True)
            self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()


def send_metrics(handler: BaseHTTPRequestHandler, metrics: ServeMetrics) -> None:
    send_text(handler, 200, metrics.exposition(), content_type=CONTENT_TYPE)


class _MetricsHandler(BaseHTTPRequestHandler):
    """The metrics port: ``GET /metrics`` only (with the token unless ``metrics_need_token`` is false)."""

    app: MetricsApp
    server_version = "posttrain-serve"
    timeout = 30

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = urlsplit(self.path).path
        if path != "/metrics":
            send_text(self, 404, b"only /metrics here\n")
        elif metrics_need_token(self.app.config) and not self.app.authorized(self.headers.get("Authorization")):
            send_text(self, 401, b"missing or wrong bearer token (Authorization: Bearer <token>)\n",
                       {"WWW-Authenticate": "Bearer"})
        else:
            send_metrics(self, self.app.metrics)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)  # a scrape every few seconds: not at info


def send_text(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str] | None = None,
               content_type: str = "text/plain; charset=utf-8") -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(data)
