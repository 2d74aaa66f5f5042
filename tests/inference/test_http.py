"""The hot-load client's HTTP layer (``HotLoadHTTP``) against a scripted session: the token, retries,
Retry-After, deadlines, error decoding and paging."""

from __future__ import annotations

import email.utils
import time

import pytest
import requests

from posttrain.inference.config import HotLoadConfig
from posttrain.inference.contract import HotLoadAPIError, HotLoadUnavailable
from posttrain.inference.http import HotLoadHTTP
from tests.inference.fake_http import FakeSession, reply
from tests.support.serving import TOKEN


class Clock:
    """A clock that only moves when something sleeps on it."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _http(*script, **fields) -> tuple[HotLoadHTTP, FakeSession, Clock]:
    config = HotLoadConfig(**{"api_url": "http://api.test", "deployment_id": "dep", "token": TOKEN,
                              "backoff_base": 0.1, "backoff_max": 1.0, **fields})
    session, clock = FakeSession(list(script)), Clock()
    return HotLoadHTTP(config, session=session, sleep=clock.sleep, clock=clock), session, clock


def test_the_token_goes_in_the_header_and_is_scrubbed_from_error_messages():
    http, session, _ = _http(reply(401, {"code": 16, "message": f"token Bearer {TOKEN} is not valid"}))
    with pytest.raises(HotLoadAPIError) as info:
        http.request("get hot-load", "GET", "/v1alpha1/inference/hotLoads/x")
    e = info.value
    assert (e.status, e.code) == (401, 16) and not isinstance(e, HotLoadUnavailable)
    assert TOKEN not in str(e) and "token Bearer *** is not valid" in str(e)
    assert "get hot-load (GET /v1alpha1/inference/hotLoads/x) for deployment dep failed: HTTP 401" in str(e)
    (call,) = session.calls  # a 4xx is not retried
    assert call["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert TOKEN not in call["url"] and call["url"] == "http://api.test/v1alpha1/inference/hotLoads/x"
    assert call["allow_redirects"] is False


def test_5xx_and_429_are_retried_with_backoff_and_retry_after():
    http, session, clock = _http(reply(503, {"error": {"code": 14, "message": "down"}}),
                                 reply(429, {"message": "slow down"}, headers={"Retry-After": "3"}),
                                 reply(200, {"ok": 1}))
    assert http.request("list hot-loads", "GET", "/p") == {"ok": 1}
    assert len(session.calls) == 3 and http.retries == 2
    first, second = clock.sleeps
    assert 0.05 <= first <= 0.1  # backoff_base with jitter
    assert second == 3  # Retry-After beats the backoff (0.1 to 0.2)


def test_retry_after_as_an_http_date():
    when = email.utils.formatdate(time.time() + 20, usegmt=True)
    http, _, clock = _http(reply(503, text="busy", headers={"Retry-After": when}), reply(200, {}))
    http.request("get", "GET", "/p")
    assert 17 <= clock.sleeps[0] <= 20


def test_connection_errors_give_up_after_max_attempts_without_chaining_the_request():
    error = requests.ConnectionError(f"refused; headers were Authorization: Bearer {TOKEN}")
    http, session, _ = _http(error, error, error, max_attempts=3)
    with pytest.raises(HotLoadUnavailable) as info:
        http.request("create hot-load", "POST", "/p", json={"a": 1})
    e = info.value
    assert e.status is None and "gave up after 3 attempts" in str(e) and "ConnectionError" in str(e)
    assert TOKEN not in str(e) and TOKEN not in repr(e)
    assert e.__cause__ is None and e.__suppress_context__  # the request (and its header) is not attached
    assert len(session.calls) == 3 and http.retries == 2


def test_without_retry_a_transient_failure_is_raised_at_once():
    http, session, clock = _http(reply(502, {"code": 14, "message": "bad gateway"}, headers={"Retry-After": "7"}))
    with pytest.raises(HotLoadUnavailable) as info:
        http.request("create hot-load", "POST", "/p", retry=False)
    assert (info.value.status, info.value.code, info.value.retry_after) == (502, 14, 7.0)
    assert "bad gateway" in str(info.value) and len(session.calls) == 1 and clock.sleeps == []


def test_replies_that_are_not_json_objects_and_404s():
    http, _, _ = _http(reply(404, {"code": 5, "message": "no such hot-load"}),
                       reply(404, {"code": 5, "message": "no such hot-load"}),
                       reply(200, [1, 2]), reply(200, text="<html>"), reply(400, text="plain text refusal"))
    assert http.request("get hot-load", "GET", "/p", not_found_ok=True) is None
    with pytest.raises(HotLoadAPIError, match="HTTP 404: no such hot-load") as info:
        http.request("get hot-load", "GET", "/p")
    assert info.value.code == 5
    for _ in range(2):
        with pytest.raises(HotLoadAPIError, match=r"the reply is not a JSON object \(HTTP 200\)"):
            http.request("get hot-load", "GET", "/p")
    with pytest.raises(HotLoadAPIError, match="HTTP 400: plain text refusal") as info:
        http.request("get hot-load", "GET", "/p")
    assert info.value.code is None


def test_a_pause_never_passes_the_deadline():
    http, _, clock = _http()
    http.backoff(1, 100.0, clock() + 2.5, "why")
    http.pause(5.0, clock() + 1.0)
    http.pause(5.0, clock() - 1.0)  # already past: no sleep at all
    http.pause(0.25, None)
    assert clock.sleeps == [2.5, 1.0, 0.25] and http.retries == 1


def test_pages_are_walked_and_a_repeated_page_token_is_refused():
    http, session, _ = _http(reply(200, {"items": [{"a": 1}, "junk"], "nextPageToken": "t1"}),
                             reply(200, {"items": [{"a": 2}]}),
                             reply(200, {"items": [], "nextPageToken": "t"}),
                             reply(200, {"items": [], "nextPageToken": "t"}),
                             reply(200, {"items": {"a": 1}}))
    assert http.pages("list things", "/things", "items", {"maxPageSize": 2}) == [{"a": 1}, {"a": 2}]
    assert [c["params"] for c in session.calls] == [{"maxPageSize": 2}, {"maxPageSize": 2, "pageToken": "t1"}]
    with pytest.raises(HotLoadAPIError, match="list things .* repeated a page token"):
        http.pages("list things", "/things", "items", {})
    with pytest.raises(HotLoadAPIError, match="items is not a list"):
        http.pages("list things", "/things", "items", {})


def test_close_closes_the_session():
    http, session, _ = _http()
    http.close()
    assert session.closed


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-5", "1e999", "soon", "99999999999999999999",
                                   "Mon, 99 Foo 2024 99:99:99 GMT"])
def test_garbage_retry_after_is_ignored(value):
    http, _, clock = _http(reply(503, text="busy", headers={"Retry-After": value}), reply(200, {}))
    assert http.request("get", "GET", "/p") == {}
    assert len(clock.sleeps) == 1 and 0.05 <= clock.sleeps[0] <= 0.1  # the client's own backoff


def test_retry_after_never_waits_past_the_clients_deadline():
    busy = reply(503, text="busy", headers={"Retry-After": "3600"})
    http, session, clock = _http(busy, busy, busy, timeout=30, max_attempts=10)
    start = clock()
    with pytest.raises(HotLoadUnavailable, match="deadline of 30s passed"):
        http.request("get", "GET", "/p")
    assert clock() - start == 30 and clock.sleeps == [30.0] and len(session.calls) == 2
    # within a hot-load, its own deadline (set by the loader) comes first
    http, session, clock = _http(busy, busy, max_attempts=10)
    http.deadline = clock() + 5
    with pytest.raises(HotLoadUnavailable, match="gave up after 2 attempts"):
        http.request("get", "GET", "/p")
    assert clock.sleeps == [5.0]
