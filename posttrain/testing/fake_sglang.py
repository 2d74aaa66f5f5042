"""``FakeSGLang``: a stand-in for the HTTP API of an SGLang server, for adapter tests.

SGLang's wheels need CUDA, so the ``posttrain serve --engine sglang`` adapter is tested
against this fake. Its routes, request fields, response bodies, messages and status
codes are taken from SGLang's source as described in ``docs/sglang-http-api.md``
(sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py`` as stored at commit
0025436eab0556737d615b36a4dd3e1e26e82f3d, request types from
``python/sglang/srt/managers/io_struct.py`` at commit 001067fffe33427bee0ed2f007fb7551a1d76b44,
the weight-loading failure paths from ``ModelRunner.update_weights_from_disk``). Read that
document for which fact comes from where.

Routes::

    GET  /health, /health_generate      200 empty body; 503 while unhealthy
    GET  /get_model_info                model_path, tokenizer_path, is_generation,
                                        preferred_sampling_params, weight_version
    GET  /get_weight_version            {"weight_version": ...}
    POST /update_weight_version         {"new_version", "abort_all_requests"}
    POST /update_weights_from_disk      {"model_path", "weight_version", "abort_all_requests", ...}
    POST /pause_generation              {"mode": "abort" | "retract" | "in_place"}
    POST /continue_generation           {}
    GET|POST /flush_cache               200 text; 400 text while paused in place with requests held
    POST|PUT /generate                  input_ids (or text), sampling_params (one, or one per
                                        prompt of a batch), return_logprob
    GET|POST /get_weights_by_name       {"name", "truncate_size"}: values held now (``fake_sglang_weights``)
    GET  /get_server_info               server args: model_path, dtype (``--dtype``), tp/dp size, ...

The "model" (``fake_sglang_model``) is a folder of ``*.safetensors`` files plus a version string. An update
checks the new folder the way SGLang observably does: a missing folder fails with
"Failed to get weights iterator: ..." (HTTP 400, ``success: false``); a folder without
safetensors, a tensor the served model does not have, or a tensor whose shape differs
from the served one fails with "Failed to update weights: ...\\nRolling back to original
weights." (HTTP 400); in every failure the old folder and version stay served.
``/generate`` returns token ids and logprobs computed from (weights folder, version,
prompt), so a test can tell which weights answered. While generation is paused a
``/generate`` call waits for ``/continue_generation`` (as SGLang holds new requests);
a later pause with mode ``abort`` answers the waiting ones with ``finish_reason`` type
``abort`` and no tokens, as does waiting longer than ``generate_wait_s``.

Test hooks: ``requests`` (log of (method, path, body)), ``fail_next(route, status, body)``,
``set_healthy(False)``, ``die()`` (stop answering: the listening socket and open connections are closed),
``held`` (number of /generate calls waiting while generation is paused), ``weights`` (what the model
holds, with its injections: a dropped tensor, a cached reload, other weights, NaN).

Not modelled: real inference or tokenization (``text`` prompts are turned into bytes as token ids),
streaming (``stream: true`` is refused with 400), batching limits, the KV/radix cache, data, tensor and pipeline parallelism, ``/v1/*`` OpenAI routes, an update's dtype checks (only
names and shapes are compared; SGLang would also fail on a dtype it cannot cast, or partly load a folder
missing some tensors), the time a real load takes, API keys, and the multi-tokenizer mode.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from posttrain.testing.fake_sglang_model import DEFAULT_MAX_NEW_TOKENS, check_update, one_output, safetensors_shapes
from posttrain.testing.fake_sglang_model import validation_error as _validation_error
from posttrain.testing.fake_sglang_weights import HeldWeights

PAUSE_MODES = ("abort", "retract", "in_place")
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


@dataclass
class RequestRecord:
    method: str
    path: str
    body: Any


@dataclass
class _Failure:
    status: int
    body: Any


@dataclass
class _State:
    model_path: str
    weight_version: str
    shapes: dict[str, list[int]]
    paused: bool = False
    pause_mode: str | None = None
    healthy: bool = True
    held: int = 0
    aborts: int = 0
    failures: dict[str, list[_Failure]] = field(default_factory=dict)


class FakeSGLang:
    """An SGLang-shaped HTTP server on 127.0.0.1 serving one weights folder."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        weight_version: str = "default",
        port: int = 0,
        generate_wait_s: float = 30.0,
        dtype: str = "auto",
    ) -> None:
        folder = Path(model_path)
        if not folder.is_dir():
            raise ValueError(f"FakeSGLang model_path {str(folder)!r}: not a folder")
        self._state = _State(str(folder), weight_version, safetensors_shapes(folder))
        self._dtype = dtype  # SGLang's --dtype
        self.weights = HeldWeights(folder, dtype)  # what the model holds; test injections on it
        self._cond = threading.Condition()
        self._log: list[RequestRecord] = []
        self._generate_wait_s = generate_wait_s
        self._rid = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self._server.daemon_threads = True
        self._server.fake = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None
        self._dead = False
        self._conns: set[socket.socket] = set()  # open keep-alive connections, closed by die()

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeSGLang:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-sglang", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._state.paused = False
            self._cond.notify_all()
        if not self._dead:
            self._dead = True
            self._server.shutdown()
            self._server.server_close()

    def die(self) -> None:
        """Stop answering, as a killed process would: close the listening socket (later connections are
        refused) and every open connection (a pooled keep-alive connection gets a reset)."""
        self.stop()
        with self._cond:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> FakeSGLang:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inspection and hooks -------------------------------------------------------------
    @property
    def requests(self) -> list[RequestRecord]:
        with self._cond:
            return list(self._log)

    @property
    def model_path(self) -> str:
        return self._state.model_path

    @property
    def weight_version(self) -> str:
        return self._state.weight_version

    @property
    def paused(self) -> bool:
        return self._state.paused

    @property
    def held(self) -> int:
        with self._cond:
            return self._state.held

    def fail_next(self, route: str, status: int, body: Any = None) -> None:
        """Answer the next request to ``route`` with ``status`` and ``body`` (JSON if not bytes/str)."""
        with self._cond:
            self._state.failures.setdefault(route, []).append(_Failure(status, body))

    def set_healthy(self, healthy: bool) -> None:
        with self._cond:
            self._state.healthy = healthy

    # -- route logic (called by the handler) ---------------------------------------------
    def _record(self, method: str, path: str, body: Any) -> _Failure | None:
        with self._cond:
            self._log.append(RequestRecord(method, path, body))
            queue = self._state.failures.get(path)
            return queue.pop(0) if queue else None

    def _health(self, _: object = None) -> tuple[int, Any]:
        return (200 if self._state.healthy else 503), b""

    def _model_info(self, _: object = None) -> tuple[int, Any]:
        s = self._state
        return 200, {
            "model_path": s.model_path,
            "tokenizer_path": s.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": s.weight_version,
        }

    def _weight_version(self, _: object = None) -> tuple[int, Any]:
        return 200, {"weight_version": self.weight_version}

    def _update_weight_version(self, body: Mapping[str, Any]) -> tuple[int, Any]:
        if "new_version" not in body:
            return _validation_error("new_version: Field required")
        new = str(body["new_version"])
        with self._cond:
            self._state.weight_version = new
        return 200, {"success": True, "message": f"Weight version updated to {new}", "new_version": new}

    def _update_weights_from_disk(self, body: Mapping[str, Any]) -> tuple[int, Any]:
        if not isinstance(body.get("model_path"), str):
            return _validation_error("model_path: Field required")
        ok, message, new = check_update(body["model_path"], self._state.shapes)
        folder = Path(body["model_path"])
        with self._cond:
            if ok:
                self._state.model_path = str(folder)
                self._state.shapes = new
                self.weights.reload(folder)
                version = body.get("weight_version")
                if version is not None:
                    self._state.weight_version = str(version)
                    message += f" Weight version updated to {version}."
        return (200 if ok else 400), {"success": ok, "message": message, "num_paused_requests": 0}

    def _weights_by_name(self, body: Mapping[str, Any]) -> tuple[int, Any]:
        with self._cond:
            return self.weights.route(body)

    def _server_info(self, _: object = None) -> tuple[int, Any]:
        s = self._state  # a few of SGLang's server args (dataclasses.asdict(server_args), ...)
        return 200, {"model_path": s.model_path, "tokenizer_path": s.model_path, "dtype": self._dtype, "tp_size": 1,
                     "dp_size": 1, "pp_size": 1, "quantization": None, "weight_version": s.weight_version}

    def _pause(self, body: Mapping[str, Any]) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _validation_error(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        with self._cond:
            self._state.paused = True
            self._state.pause_mode = mode
            if mode == "abort":  # requests held by an earlier pause are aborted; new ones wait
                self._state.aborts += 1
            self._cond.notify_all()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, _: object = None) -> tuple[int, Any]:
        with self._cond:
            self._state.paused = False
            self._state.pause_mode = None
            self._cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _flush_cache(self, _: object = None) -> tuple[int, Any]:
        with self._cond:
            busy = self._state.paused and self._state.pause_mode == "in_place" and self._state.held > 0
        return (400 if busy else 200), FLUSH_OK.encode()

    def _generate(self, body: Mapping[str, Any]) -> tuple[int, Any]:
        if body.get("stream"):
            return 400, {"error": {"message": "FakeSGLang does not model stream=true"}}
        prompts = body.get("input_ids")
        if prompts is None and isinstance(body.get("text"), (str, list)):
            texts = body["text"]
            prompts = [list(t.encode()) for t in texts] if isinstance(texts, list) else list(texts.encode())
        if not prompts:
            return 400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
        batch = isinstance(prompts[0], list)
        items = prompts if batch else [prompts]
        params = body.get("sampling_params") or {}
        per_item = params if isinstance(params, list) else [params] * len(items)  # a list: one per prompt
        if len(per_item) != len(items):
            return 400, {"error": {"message": "The length of sampling_params does not match the batch size."}}
        max_new = [int((p or {}).get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)) for p in per_item]
        with self._cond:
            self._state.held += 1
            try:
                deadline = time.monotonic() + self._generate_wait_s
                aborts = self._state.aborts
                while self._state.paused and not self._dead and self._state.aborts == aborts:
                    if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                        break
                aborted = self._state.aborts != aborts or self._state.paused
                folder, version = self._state.model_path, self._state.weight_version
                self._rid += 1
                rid = self._rid
            finally:
                self._state.held -= 1
        outs = [
            one_output(f"{rid:032x}-{i}", p, max_new[i], folder, version, bool(body.get("return_logprob")), aborted)
            for i, p in enumerate(items)
        ]
        return 200, (outs if batch else outs[0])


ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/health"): "health",
    ("GET", "/health_generate"): "health",
    ("GET", "/get_model_info"): "model_info",
    ("GET", "/get_weight_version"): "weight_version",
    ("GET", "/get_server_info"): "server_info",
    ("GET", "/get_weights_by_name"): "weights_by_name",
    ("POST", "/get_weights_by_name"): "weights_by_name",
    ("POST", "/update_weight_version"): "update_weight_version",
    ("POST", "/update_weights_from_disk"): "update_weights_from_disk",
    ("POST", "/pause_generation"): "pause",
    ("POST", "/continue_generation"): "continue",
    ("GET", "/flush_cache"): "flush_cache",
    ("POST", "/flush_cache"): "flush_cache",
    ("POST", "/generate"): "generate",
    ("PUT", "/generate"): "generate",
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        fake: FakeSGLang = self.server.fake  # type: ignore[attr-defined]
        with fake._cond:
            fake._conns.add(self.connection)

    def finish(self) -> None:
        fake: FakeSGLang = self.server.fake  # type: ignore[attr-defined]
        with fake._cond:
            fake._conns.discard(self.connection)
        super().finish()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def _dispatch(self, method: str) -> None:
        fake: FakeSGLang = self.server.fake  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else {}
        except ValueError:
            self._send(*_validation_error("JSON decode error"))
            return
        failure = fake._record(method, path, body)
        if failure is not None:
            self._send(failure.status, failure.body if failure.body is not None else b"")
            return
        route = ROUTES.get((method, path))
        if route is None:
            known = {p for _, p in ROUTES}
            status = HTTPStatus.METHOD_NOT_ALLOWED if path in known else HTTPStatus.NOT_FOUND
            self._send(status, {"detail": status.phrase})
            return
        if not isinstance(body, dict):
            self._send(*_validation_error("body: expected a JSON object"))
            return
        self._send(*getattr(fake, f"_{route}")(body))  # each route method takes the body

    def _send(self, status: int, body: Any) -> None:
        if isinstance(body, bytes):
            data, ctype = body, "text/plain; charset=utf-8"
        elif isinstance(body, str):
            data, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(int(status))
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
