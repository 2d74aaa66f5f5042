"""``posttrain serve``: the reference inference server on the standard library's HTTP server.

Routes (every one needs ``Authorization: Bearer <token>``):

- ``POST /v1/completions``: token-id prompts, ``n`` choices sampled in one batch, per-token log-probs;
- ``GET /v1/models``, ``GET /health``;
- ``GET /metrics`` (Prometheus, docs/metrics.md), unless ``metrics_port`` serves it (``metrics_http``);
- the hot-load API of docs/hotload-api.md under ``/v1alpha1/inference/hotLoads``;
- with test hooks only: ``POST|DELETE /_test/faults`` and ``GET /_test/stats``.

The standard library server (not an ASGI one) is used because a test fault must be able to
close a connection without answering, which is what a lost reply looks like to a client.
"""

from __future__ import annotations

import hmac
import json
import re
import shutil
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from pydantic import ValidationError

from posttrain import redact
from posttrain.chain.fetch import SnapshotSource
from posttrain.publish.lock import WorkDirBusy, WorkDirLock
from posttrain.inference.protocol import (
    API_PREFIX,
    GRPC_HTTP_STATUS,
    GRPC_INTERNAL,
    GRPC_INVALID_ARGUMENT,
    GRPC_NOT_FOUND,
    GRPC_UNAUTHENTICATED,
    GRPC_UNAVAILABLE,
)
from posttrain.serve.completions import RequestError
from posttrain.serve.engine import Engine
from posttrain.serve.faults import FAULT_LIST, FaultBox
from posttrain.serve.hotload_service import HotLoadService, ServiceError
from posttrain.serve.http_body import read_body
from posttrain.serve.metrics import PublishTimes, ServeMetrics
from posttrain.serve.metrics_http import MetricsPort, send_metrics
from posttrain.serve.serve_config import ServeConfig

log = redact.logger(__name__)  # every record scrubbed (S3 credentials, URL userinfo)

MAX_BODY_BYTES = 32 << 20
GRPC_NAMES = {3: "INVALID_ARGUMENT", 5: "NOT_FOUND", 6: "ALREADY_EXISTS", 8: "RESOURCE_EXHAUSTED",
              9: "FAILED_PRECONDITION", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
              16: "UNAUTHENTICATED"}


class _DropReply(Exception):
    """Close the connection without answering (test fault)."""


class ServeStartError(ValueError):
    """The server cannot start: one line naming the setting at fault."""


class InferenceServer:
    def __init__(self, config: ServeConfig, engine: Engine | None = None):
        self.config = config
        _check_model_dir(config.model_dir)
        # bound first, so that a port in use fails before minutes of loading; listening once loaded,
        # so that until then a connection is refused rather than left waiting
        self.httpd = ThreadingHTTPServer((config.host, config.port), _handler_for(self), bind_and_activate=False)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        self.metrics_httpd: MetricsPort | None = None
        try:
            try:
                self.httpd.server_bind()
            except OSError as e:
                raise ServeStartError(f"port {config.port} (--port): cannot listen on {config.host}:{config.port}: "
                                      f"{e.strerror or e}") from None
            if config.metrics_port is not None:
                self.metrics_httpd = MetricsPort(self, config.host, config.metrics_port, ServeStartError)
            self._open(config, engine)
            self.httpd.server_activate()
            if self.metrics_httpd is not None:
                self.metrics_httpd.activate()
        except BaseException:
            self.httpd.server_close()
            if self.metrics_httpd is not None:
                self.metrics_httpd.close()
            # what _open had opened before the failure: an engine's processes would outlive the error
            for opened in ("engine", "store"):
                if getattr(self, opened, None) is not None:
                    try:
                        getattr(self, opened).close()
                    except Exception:  # noqa: BLE001, S110 - the start error is the one to raise
                        pass
            if getattr(self, "_work_lock", None) is not None:
                self._work_lock.release()
            raise

    def _open(self, config: ServeConfig, engine: Engine | None) -> None:
        from posttrain.storage import StorageError, open_store

        try:
            self.store = open_store(config.store, **config.store_options)
        except (OSError, StorageError) as e:
            what = "is a file, not a folder" if Path(config.store).is_file() else (getattr(e, "strerror", None) or e)
            raise ServeStartError(f"store (--store) {config.store}: {what}") from None
        self._own_work_dir = config.work_dir is None
        self.work_dir = config.work_dir or Path(tempfile.mkdtemp(prefix="posttrain-serve-"))
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            # one server per work dir: a second would delete the folders the first serves
            self._work_lock = WorkDirLock(self.work_dir, owner="posttrain serve")
        except OSError as e:  # of a file there, mkdir says only "File exists"
            why = "is a file, not a folder" if self.work_dir.is_file() else e.strerror or e
            raise ServeStartError(f"work_dir (--work-dir) {self.work_dir}: {why}") from None
        except WorkDirBusy as e:
            raise ServeStartError(f"work_dir (--work-dir): {e}") from None
        self.faults = FaultBox(config.faults)  # armed at start, or through /_test/faults; the engine's too
        self.engine = engine or open_engine(config, self.faults)
        self.model_name = self.engine.model_name
        self.test_hooks = config.test_hooks or bool(config.faults)
        self.metrics = ServeMetrics()  # a registry of its own: servers in one process keep their figures apart
        self.service = HotLoadService(
            deployment_id=config.deployment_id,
            source=SnapshotSource(self.store, config.prefix, self.work_dir / "cache"),
            engine=self.engine,
            work_dir=self.work_dir,
            faults=self.faults,
            boot_dir=config.model_dir,
            metrics=self.metrics,
        )
        self.metrics.watch(self.service, self.engine, PublishTimes(self.store, config.prefix))
        self._token = config.token.get_secret_value().encode()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def metrics_url(self) -> str:
        """Where /metrics is served: the metrics port's URL, else the main one's."""
        return self.url if self.metrics_httpd is None else self.metrics_httpd.url

    def start(self) -> InferenceServer:
        """Serve in a background thread."""
        if self.metrics_httpd is not None:
            self.metrics_httpd.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="posttrain-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        if self.metrics_httpd is not None:
            self.metrics_httpd.start()
        self.httpd.serve_forever(poll_interval=0.05)

    def shutdown(self) -> None:
        if self.metrics_httpd is not None:
            self.metrics_httpd.close()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.service.wait(timeout=30)
        self.engine.close()
        self.store.close()
        self._work_lock.release()
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def authorized(self, header: str | None) -> bool:
        return header is not None and hmac.compare_digest(header.encode(), b"Bearer " + self._token)


def _check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise ServeStartError(f"model_dir (--model) {model_dir}: not a folder")
    if not (model_dir / "config.json").is_file():
        raise ServeStartError(f"model_dir (--model) {model_dir}: no config.json, so not a Hugging Face model folder")


def open_engine(config: ServeConfig, faults: FaultBox | None = None) -> Engine:
    """The engine ``config.engine`` names, started on ``config.model_dir`` (the reference one takes ``faults``)."""
    if config.engine == "vllm":
        from posttrain.serve.vllm.engine import open_vllm_engine

        return open_vllm_engine(config)
    if config.engine == "sglang":
        from posttrain.serve.sglang import open_sglang_engine

        return open_sglang_engine(config)
    from posttrain.serve.reference import ReferenceEngine

    return ReferenceEngine(config, faults)


def _handler_for(app: InferenceServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.app = app
    return Handler


class _Handler(BaseHTTPRequestHandler):
    app: InferenceServer
    server_version = "posttrain-serve"
    timeout = 120  # seconds a connection may sit idle mid-request

    ROUTES = [
        ("GET", re.compile(r"^/health$"), "health"),
        ("GET", re.compile(r"^/v1/models$"), "models"),
        ("POST", re.compile(r"^/v1/completions$"), "completions"),
        ("GET", re.compile(r"^/metrics$"), "metrics"),
        ("POST", re.compile(rf"^{API_PREFIX}$"), "create"),
        ("GET", re.compile(rf"^{API_PREFIX}$"), "list"),
        ("GET", re.compile(rf"^{API_PREFIX}/(?P<id>[^/:]+)$"), "get"),
        ("GET", re.compile(rf"^{API_PREFIX}/(?P<id>[^/:]+)/replicas$"), "replicas"),
        ("POST", re.compile(rf"^{API_PREFIX}/(?P<id>[^/:]+):cancel$"), "cancel"),
        ("POST", re.compile(r"^/_test/faults$"), "add_faults"),
        ("DELETE", re.compile(r"^/_test/faults$"), "clear_faults"),
        ("GET", re.compile(r"^/_test/stats$"), "stats"),
    ]

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        # the request line only (method, path, status): headers, and so the token, are never logged
        log.info("%s %s", self.address_string(), format % args)

    # ------------------------------------------------------------------ dispatch
    def _handle(self, method: str) -> None:
        parts = urlsplit(self.path)
        path, self.query = parts.path, parse_qs(parts.query)
        openai = path.startswith("/v1/") or path == "/health"
        try:
            if not self.app.authorized(self.headers.get("Authorization")):
                raise _unauthenticated(openai)
            fault = self.app.faults.take("http_error", method=method, path=path)
            if fault is not None:
                extra = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else {}
                self._send(fault.status, {"code": GRPC_UNAVAILABLE, "message": "injected fault", "details": []},
                           extra)
                return
            for m, pattern, name in self.ROUTES:
                match = pattern.fullmatch(path)
                if match and m == method:
                    if name in ("add_faults", "clear_faults", "stats") and not self.app.test_hooks:
                        break
                    if name == "metrics" and self.app.metrics_httpd is not None:
                        break  # served on the metrics port
                    getattr(self, f"_{name}")(**match.groupdict())
                    return
            if openai:
                raise RequestError(404, f"no route {method} {path}", kind="NotFoundError")
            raise ServiceError(GRPC_NOT_FOUND, f"no route {method} {path}")
        except _DropReply:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except RequestError as e:
            self._send(e.status, e.to_json())
        except ServiceError as e:
            self._send(GRPC_HTTP_STATUS.get(e.code, 500),
                       {"code": e.code, "message": e.message, "status": GRPC_NAMES.get(e.code, ""), "details": []})
        except Exception:  # noqa: BLE001 - a bug answers 500 and is logged, the server keeps serving
            log.exception("%s %s failed", method, path)
            if openai:
                self._send(500, RequestError(500, "internal error", kind="InternalServerError").to_json())
            else:
                self._send(500, {"code": GRPC_INTERNAL, "message": "internal error", "details": []})

    def _send(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        text = json.dumps(body)
        # an error reply may quote a store's error; replies that carry tokens and text are left alone
        data = (redact.scrub(text) if status >= 400 else text).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> object:
        """The JSON request body, read up to MAX_BODY_BYTES whatever the headers claim."""
        raw = read_body(self.rfile, self.headers, MAX_BODY_BYTES, self._refuse)
        try:
            return json.loads(raw) if raw else {}
        except RecursionError:
            raise RequestError(400, "the request body is nested too deeply") from None
        except ValueError:
            raise RequestError(400, "the request body is not valid JSON") from None

    def _refuse(self, status: int, message: str) -> RequestError:
        """An error for a body that was not read to its end: the connection cannot be reused."""
        self.close_connection = True
        return RequestError(status, message)

    def _qint(self, name: str) -> int | None:
        values = self.query.get(name)
        if not values:
            return None
        try:
            return int(values[0])
        except ValueError:
            raise ServiceError(GRPC_INVALID_ARGUMENT, f"{name} must be an integer") from None

    def _qstr(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    # ------------------------------------------------------------------ routes
    def _health(self) -> None:
        served = self.app.engine.current()
        self._send(200, {"status": "ok", "deploymentId": self.app.config.deployment_id,
                         "snapshotIdentity": served.identity,
                         # resumed: serving again what it served before a restart; clean: the boot weights
                         "boot": "resumed" if self.app.service.resumed is not None else "clean"})

    def _models(self) -> None:
        served = self.app.engine.current()
        self._send(200, {"object": "list", "data": [{
            "id": self.app.model_name, "object": "model", "owned_by": "posttrain",
            "max_model_len": self.app.engine.max_positions, "snapshot_identity": served.identity,
        }]})

    def _completions(self) -> None:
        with self.app.metrics.completion() as counted:
            counted.reply = self.app.engine.complete(self._body())
        self._send(200, counted.reply)

    def _metrics(self) -> None:
        send_metrics(self, self.app.metrics)

    def _create(self) -> None:
        body = self._body()
        if not isinstance(body, dict):
            raise ServiceError(GRPC_INVALID_ARGUMENT, "the request body must be a JSON object")
        op = self.app.service.create(body)
        if self.app.faults.take("drop_create_reply") is not None:
            log.warning("hot-load %s: dropping the create reply (injected fault)", op.id)
            raise _DropReply
        self._send(200, {"hotLoad": op.to_json()})

    def _get(self, id: str) -> None:  # noqa: A002 - the route's parameter
        self._send(200, {"hotLoad": self.app.service.get(id).to_json()})

    def _list(self) -> None:
        ops, token = self.app.service.list(self._qstr("parentDeploymentId"), self._qint("maxPageSize"),
                                           self._qstr("pageToken"))
        self._send(200, {"hotLoads": [o.to_json() for o in ops], "nextPageToken": token})

    def _replicas(self, id: str) -> None:  # noqa: A002
        reps, token = self.app.service.replicas(id, self._qint("maxPageSize"), self._qstr("pageToken"))
        self._send(200, {"replicas": [r.to_json() for r in reps], "nextPageToken": token})

    def _cancel(self, id: str) -> None:  # noqa: A002
        self.app.service.cancel(id)

    def _add_faults(self) -> None:
        body = self._body()
        try:
            faults = FAULT_LIST.validate_python(body.get("faults", []) if isinstance(body, dict) else body)
        except ValidationError as e:
            raise ServiceError(GRPC_INVALID_ARGUMENT, f"bad faults: {e.errors(include_url=False)}") from None
        self.app.faults.add(faults)
        self._send(200, {"pending": self.app.faults.pending()})

    def _clear_faults(self) -> None:
        self.app.faults.clear()
        self._send(200, {"pending": []})

    def _stats(self) -> None:
        served = self.app.engine.current()
        self._send(200, {"creates": dict(self.app.service.creates), "pending": self.app.faults.pending(),
                         "snapshotIdentity": served.identity})


def _unauthenticated(openai: bool) -> Exception:
    message = "missing or wrong bearer token (Authorization: Bearer <token>)"
    if openai:
        return RequestError(401, message, kind="AuthenticationError")
    return ServiceError(GRPC_UNAUTHENTICATED, message)
