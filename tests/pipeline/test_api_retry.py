"""The quick retry of task-run creates that a SQLite-backed Prefect server answered 503
(posttrain/pipeline/tasks/api_retry.py), against a stand-in transport that answers 503 first."""

from __future__ import annotations

import asyncio

import httpx

from posttrain.pipeline.tasks.api_retry import QuickRetryOn503, quick_retry_creates


def _server(busy: int):
    """A transport that answers 503 to the first ``busy`` requests, then 201; and what it saw."""
    seen: list[tuple[str, str, bytes]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.read()))
        return httpx.Response(503 if len(seen) <= busy else 201, json={"n": len(seen)})
    return httpx.MockTransport(answer), seen


def _send(transport, method: str, path: str) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9/api") as client:
            return await client.request(method, path, json={"name": "shard-0"})
    return asyncio.run(go())


def test_a_busy_create_is_sent_again_with_the_same_body():
    inner, seen = _server(busy=2)
    quick = QuickRetryOn503(inner, paths=("/task_runs/",), delays=(0, 0, 0))
    response = _send(quick, "POST", "/task_runs/")
    assert response.status_code == 201
    assert [m for m, _, _ in seen] == ["POST"] * 3
    assert len({body for _, _, body in seen}) == 1 and b"shard-0" in seen[0][2]
    assert quick.retried == 2


def test_after_the_delays_the_503_goes_to_the_client():
    inner, seen = _server(busy=10)
    quick = QuickRetryOn503(inner, paths=("/task_runs/",), delays=(0, 0))
    assert _send(quick, "POST", "/task_runs/").status_code == 503
    assert len(seen) == 3  # the first try and two retries


def test_other_requests_are_not_retried():
    for method, path in [("GET", "/task_runs/"), ("POST", "/flow_runs/filter")]:
        inner, seen = _server(busy=1)
        assert _send(QuickRetryOn503(inner, paths=("/task_runs/",), delays=(0,)), method, path).status_code == 503
        assert len(seen) == 1


def test_the_sync_client_path_retries_too():
    inner, seen = _server(busy=1)
    with httpx.Client(transport=QuickRetryOn503(inner, paths=("/flow_runs/",), delays=(0,)),
                      base_url="http://127.0.0.1:9/api") as client:
        assert client.post("/flow_runs/", json={"name": "round-0-shard-0"}).status_code == 201
    assert len(seen) == 2


def test_prefect_clients_are_wrapped_once():
    from prefect.client.orchestration import PrefectClient, SyncPrefectClient

    for client in (PrefectClient("http://127.0.0.1:9/api"), SyncPrefectClient("http://127.0.0.1:9/api")):
        quick_retry_creates(client)
        quick_retry_creates(client)
        transport = client._client._transport
        assert isinstance(transport, QuickRetryOn503) and not isinstance(transport.inner, QuickRetryOn503)
