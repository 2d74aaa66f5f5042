"""An S3 store rides out an outage: the configured policy covers at least a minute, and a real
outage of a few seconds (nothing listening, then the store back) is survived by every call."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from posttrain.storage import S3Store, S3StoreConfig, StorageError
from posttrain.storage.outage import outage_delays, retry_outage, transient
from posttrain.testing.faultproxy import FaultProxy
from tests.support.s3 import free_port, s3_config


def test_the_default_policy_covers_a_minute_with_back_off():
    config = S3StoreConfig(bucket="bucket")
    delays = outage_delays(config.outage_retry_s)
    assert config.outage_retry_s >= 60 and sum(delays) >= 60
    assert delays[:5] == [1, 2, 4, 8, 16] and max(delays) == 30  # back-off, not a hammering loop
    assert config.retry_mode in ("standard", "adaptive") and config.max_attempts >= 8  # botocore's own first


def test_retries_stop_at_the_budget_and_only_for_transient_errors():
    from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError

    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    def down():
        raise EndpointConnectionError(endpoint_url="http://s3")

    with pytest.raises(EndpointConnectionError):
        retry_outage(down, budget=70, what="get", sleep=sleep, clock=lambda: now[0])
    assert sum(sleeps) == 70 and sleeps[:3] == [1, 2, 4]

    denied = ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "Put")
    busy = ClientError({"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "Put")
    slow = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "Put")
    reset = ConnectionClosedError(endpoint_url="http://s3")
    assert not transient(denied) and transient(busy) and transient(slow) and transient(reset)
    # a conditional write is sent again only when it surely did not reach the store
    assert not transient(busy, resend_safe=False) and not transient(reset, resend_safe=False)
    assert transient(slow, resend_safe=False) and transient(EndpointConnectionError(endpoint_url="x"),
                                                            resend_safe=False)


def _store_back_after(seconds: float, port: int, upstream: str) -> tuple[threading.Thread, list[FaultProxy]]:
    proxies: list[FaultProxy] = []

    def back() -> None:
        time.sleep(seconds)
        proxies.append(FaultProxy(upstream, port=port).start())

    thread = threading.Thread(target=back, daemon=True)
    thread.start()
    return thread, proxies


def test_calls_survive_a_real_outage(moto_bucket, tmp_path: Path):
    endpoint, bucket = moto_bucket
    port = free_port()
    config = s3_config(f"http://127.0.0.1:{port}", bucket, max_attempts=2, outage_retry_s=30)
    store = S3Store(config)
    (tmp_path / "f").write_bytes(b"payload")
    thread, proxies = _store_back_after(6, port, endpoint)  # nothing listens for 6 s: connections refused
    try:
        t0 = time.monotonic()
        store.put_bytes("a", b"one", if_none_match=True)  # waits through the outage
        assert time.monotonic() - t0 >= 5
        store.put_file(tmp_path / "f", "b")
        assert store.get_bytes("a")[0] == b"one" and sorted(store.list("")) == ["a", "b"]
        # and when the store does not come back within the budget, the error is the store's
        proxies[0].stop()
        quick = S3Store(config.model_copy(update={"outage_retry_s": 2.0}))
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="127.0.0.1"):
            quick.get_bytes("a")
        assert 2 <= time.monotonic() - t0 < 20
        quick.close()
    finally:
        thread.join()
        store.close()
        for p in proxies[1:]:
            p.stop()
