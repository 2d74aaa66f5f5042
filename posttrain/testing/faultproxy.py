"""``FaultProxy``: an HTTP proxy on 127.0.0.1 that fails a fraction of S3 requests.

For tests of retry paths::

    with FaultProxy("http://127.0.0.1:8333", fault_rate=0.2, seed=1) as proxy:
        store = S3Store(S3StoreConfig(bucket="b", endpoint_url=proxy.url, ...))

A faulted request never reaches the upstream server (so retrying any request is
safe) and gets either a ``503 SlowDown`` S3 error or a TCP reset. The sequence of
decisions is fixed by ``seed``; which request meets which decision depends on
thread timing. ``max_faults_per_request`` bounds the faults in a row for one
request (same method, path and Range), so that retries with backoff always get
through in bounded time.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

MODES = ("503", "reset")
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "expect", "content-length",
}  # content-length is set again for the body actually sent
CHUNK = 1024 * 1024
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate. (injected by FaultProxy)</Message></Error>"
)


class FaultProxy:
    """Forward HTTP to ``upstream``, failing about ``fault_rate`` of the requests."""

    def __init__(
        self,
        upstream: str,
        *,
        fault_rate: float = 0.0,
        seed: int = 0,
        modes: Sequence[str] = MODES,
        max_faults_per_request: int | None = 2,
        port: int = 0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"FaultProxy upstream {upstream!r}: expected http://host:port")
        unknown = set(modes) - set(MODES)
        if unknown or not modes:
            raise ValueError(f"FaultProxy modes {list(modes)!r}: choose from {MODES}")
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"FaultProxy fault_rate {fault_rate!r}: not between 0 and 1")
        self.upstream = (parts.hostname, parts.port)
        self.fault_rate = fault_rate
        self.modes = tuple(modes)
        self.max_faults_per_request = max_faults_per_request
        self.stats: Counter[str] = Counter()  # requests, and faults by mode
        self._streaks: dict[tuple[str, ...], int] = {}  # faults in a row per request
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The proxy's endpoint, to use in place of the upstream one."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def decide(self, request: tuple[str, ...] = ()) -> str | None:
        """The fate of the next ``request`` (an identity such as method, path, range):
        None (forward it) or a fault mode."""
        with self._lock:
            self.stats["requests"] += 1
            draw, mode = self._rng.random(), self._rng.choice(self.modes)
            streak = self._streaks.get(request, 0)
            limit = self.max_faults_per_request
            if draw >= self.fault_rate or (limit is not None and streak >= limit):
                self._streaks.pop(request, None)
                return None
            self._streaks[request] = streak + 1
            self.stats[mode] += 1
            return mode


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint
    _upstream: http.client.HTTPConnection | None = None

    def do_GET(self) -> None:
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def _proxy(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        fault = proxy.decide((self.command, self.path, self.headers.get("Range", "")))
        if fault == "reset":
            # SO_LINGER 0 makes close() send RST: the client sees "connection reset"
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        body = self._read_body()
        if fault == "503":
            self.send_response_only(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            self.wfile.write(SLOW_DOWN)
            return
        try:
            response = self._forward(proxy, body)
        except OSError as e:
            self._drop_upstream()
            message = f"FaultProxy: upstream failed: {e}".encode()
            self.send_response_only(502, "Bad Gateway")
            self.send_header("Content-Length", str(len(message)))
            self.end_headers()
            self.wfile.write(message)
            return
        self._relay(response)

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = self.headers.get("Content-Length")
        return self.rfile.read(int(length)) if length is not None else None

    def _forward(self, proxy: FaultProxy, body: bytes | None) -> http.client.HTTPResponse:
        if self._upstream is None:
            self._upstream = http.client.HTTPConnection(*proxy.upstream, timeout=120)
        conn = self._upstream
        # keep the client's Host header: it is part of what SigV4 signed
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in HOP_BY_HOP:
                conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        return conn.getresponse()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        length = response.getheader("Content-Length")
        no_body = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        buffered = None if (no_body or length is not None) else response.read()
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        if buffered is not None:
            self.send_header("Content-Length", str(len(buffered)))
        elif length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        if buffered is not None:
            self.wfile.write(buffered)
        elif not no_body:
            while chunk := response.read(CHUNK):
                self.wfile.write(chunk)
        response.read()  # drain, so the upstream connection can be reused
        if response.will_close:
            self._drop_upstream()

    def _drop_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def finish(self) -> None:
        self._drop_upstream()
        try:
            super().finish()
        except OSError:
            pass  # the socket was reset on purpose
