"""A quick retry of the creates that a SQLite-backed Prefect server answers 503.

SQLite fails a transaction that read before it wrote when another connection committed in
between ("database is locked"); Prefect's server rolls it back and answers 503, and Prefect's
client backs off 2, 4, 8 s. Creating a subflow's parent task run and its flow run are such
transactions (each reads labels, then inserts), and they collide now and then with the server's
own task-run recorder and event persister, which commit once a second. Sent again after tens of
milliseconds, they go through: the other writer holds the lock for one commit. This sends
nothing that Prefect's client would not send anyway: it sends a request answered 503 again too,
only 2 s later (the server answers 503 for errors it rolled back, such as the lock). After
``DELAYS_S`` the 503 goes to Prefect's client as it came.

The shard task wraps two clients: the shared one for the subflows' parent task runs, and the
parent flow's sync client, with which Prefect's engine creates each subflow's flow run (so the
parent flow's other task-run and flow-run creates retry quickly too).
"""

from __future__ import annotations

import asyncio
import time

import httpx

DELAYS_S = (0.02, 0.05, 0.1, 0.2, 0.4)


class QuickRetryOn503(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """Wraps a client's transport (sync or async): POSTs to ``paths`` answered 503 are sent again
    after each of ``delays`` seconds. ``retried`` counts those answers."""

    def __init__(self, inner, paths: tuple[str, ...], delays=DELAYS_S) -> None:
        self.inner, self.paths, self.delays = inner, paths, tuple(delays)
        self.retried = 0

    def _delays(self, request: httpx.Request) -> tuple[float, ...]:
        return self.delays if request.method == "POST" and request.url.path.endswith(self.paths) else ()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for delay in self._delays(request):
            response = self.inner.handle_request(request)
            if response.status_code != 503:
                return response
            response.close()
            self.retried += 1
            time.sleep(delay)
        return self.inner.handle_request(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for delay in self._delays(request):
            response = await self.inner.handle_async_request(request)
            if response.status_code != 503:
                return response
            await response.aclose()
            self.retried += 1
            await asyncio.sleep(delay)
        return await self.inner.handle_async_request(request)

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        await self.inner.aclose()


def quick_retry_creates(client) -> None:
    """Send a Prefect client's (sync or async) task-run and flow-run creates again quickly when
    they are answered 503 (see the module docstring); the client is wrapped in place, once."""
    http = client._client  # noqa: SLF001 - Prefect's httpx client; httpx keeps its transport here
    if not isinstance(http._transport, QuickRetryOn503):  # noqa: SLF001
        http._transport = QuickRetryOn503(http._transport, paths=("/task_runs/", "/flow_runs/"))  # noqa: SLF001
