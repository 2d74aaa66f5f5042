"""The store behind a switchable fault proxy: every client of the soak (flow runs, trainers'
publishers, gateways, the operator's CLI) reaches SeaweedFS through it. An outage is one of:

- ``refused``: the proxy stops listening (new connections are refused) and resets every request on a
  connection already open; at the end a new proxy listens on the same port;
- ``503``: every request answered ``503 SlowDown`` (S3's throttling error);
- ``slow``: every request held ``SLOW_S`` seconds before it is forwarded.
"""

from __future__ import annotations

import threading
import time

from posttrain.testing.faultproxy import FaultProxy

SLOW_S = 4.0


class SwitchProxy(FaultProxy):
    """A ``FaultProxy`` whose faults are switched on and off as a whole (``mode``), not drawn per request."""

    def __init__(self, upstream: str, *, port: int = 0) -> None:
        super().__init__(upstream, fault_rate=0.0, port=port, max_faults_per_request=None)
        self.mode: str | None = None

    def decide(self, request: tuple[str, ...] = ()) -> str | None:
        mode = self.mode
        with self._lock:
            self.stats["requests"] += 1
            if mode is not None:
                self.stats[mode] += 1
        if mode == "slow":
            time.sleep(SLOW_S)
            return None
        return mode  # None, "503" or "reset"


class StoreFront:
    """The proxy the soak's store URL names, kept on one port across ``refused`` outages."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.proxy = SwitchProxy(upstream).start()
        self.port = self.proxy._server.server_address[1]
        self.retired: list[SwitchProxy] = []  # proxies stopped by ``refused`` outages (counters kept)
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def begin(self, mode: str) -> None:
        with self._lock:
            if mode == "refused":
                self.proxy.mode = "reset"  # requests on connections already open
                self.proxy.stop()  # and no new connection
            elif mode in ("503", "slow"):
                self.proxy.mode = mode
            else:
                raise ValueError(f"store outage mode {mode!r}")

    def end(self, mode: str) -> None:
        with self._lock:
            if mode == "refused":
                self.retired.append(self.proxy)
                for attempt in range(50):  # the port may linger a moment
                    try:
                        self.proxy = SwitchProxy(self.upstream, port=self.port).start()
                        break
                    except OSError:
                        if attempt == 49:
                            raise
                        time.sleep(0.2)
            else:
                self.proxy.mode = None

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for p in (*self.retired, self.proxy):
            for k, v in p.stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def stop(self) -> None:
        self.proxy.stop()
