"""Retries: transfers through FaultProxy (503 SlowDown, connection resets) stay byte-exact."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from posttrain.storage import PreconditionFailed, S3Store, S3StoreConfig, StorageError
from posttrain.testing.faultproxy import FaultProxy

MiB = 1024 * 1024


@pytest.fixture
def proxied(
    seaweedfs_bucket: tuple[str, str], s3_config_factory: Callable[..., S3StoreConfig]
) -> Iterator[Callable[..., tuple[FaultProxy, S3Store]]]:
    """``proxied(fault_rate, seed, **config)``: an S3Store on SeaweedFS behind a FaultProxy."""
    endpoint, bucket = seaweedfs_bucket
    opened: list[tuple[FaultProxy, S3Store]] = []

    def make(
        fault_rate: float,
        seed: int = 0,
        modes: tuple[str, ...] = ("503", "reset"),
        max_faults_per_request: int | None = 2,
        **config: object,
    ) -> tuple[FaultProxy, S3Store]:
        proxy = FaultProxy(
            endpoint, fault_rate=fault_rate, seed=seed, modes=modes, max_faults_per_request=max_faults_per_request
        ).start()
        store = S3Store(s3_config_factory(proxy.url, bucket, **config))
        opened.append((proxy, store))
        return proxy, store

    yield make
    for proxy, store in opened:
        store.close()
        proxy.stop()


def test_decisions_follow_the_seed() -> None:
    def decisions(seed: int) -> list[str | None]:
        proxy = FaultProxy("http://127.0.0.1:9", fault_rate=0.2, seed=seed, max_faults_per_request=None)
        try:
            return [proxy.decide() for _ in range(200)]
        finally:
            proxy._server.server_close()

    first = decisions(7)
    assert first == decisions(7) and first != decisions(8)
    assert 20 <= sum(d is not None for d in first) <= 60 and {"503", "reset"} <= set(first)


def test_faults_in_a_row_are_bounded() -> None:
    proxy = FaultProxy("http://127.0.0.1:9", fault_rate=1.0, max_faults_per_request=2)
    try:
        assert [proxy.decide(("GET", "/b/k")) for _ in range(3)][2] is None
        assert proxy.decide(("GET", "/b/other")) is not None  # counted per request
    finally:
        proxy._server.server_close()


def test_transfers_survive_20_percent_faults(proxied, tmp_path: Path) -> None:  # noqa: ANN001
    proxy, store = proxied(0.2, seed=6, max_attempts=10)
    data = os.urandom(21 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)

    store.put_file(src, "big.bin")  # multipart: create, 5 parts, complete
    store.get_file("big.bin", tmp_path / "out.bin")  # head + 5 ranged GETs
    assert hashlib.sha256((tmp_path / "out.bin").read_bytes()).digest() == hashlib.sha256(data).digest()

    etag = store.put_bytes("ledger/latest", b"1", if_none_match=True)
    for i in range(2, 8):
        etag = store.put_bytes("ledger/latest", str(i).encode(), if_match=etag)
    assert store.get_bytes("ledger/latest") == (b"7", etag)
    for i in range(12):
        store.put_bytes(f"many/{i:02d}", b"x")
    assert list(store.list("many/")) == [f"many/{i:02d}" for i in range(12)]
    assert store.size("big.bin") == len(data) and store.exists("big.bin")

    assert proxy.stats["503"] >= 2 and proxy.stats["reset"] >= 2, proxy.stats


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_faults_surface_when_retries_run_out(proxied, mode: str) -> None:  # noqa: ANN001
    # botocore's own attempts only: no ride through an outage (tests/storage/test_outage.py)
    proxy, store = proxied(1.0, modes=(mode,), max_attempts=2, max_faults_per_request=None, outage_retry_s=0)
    with pytest.raises(StorageError) as err:
        store.put_bytes(f"k-{uuid.uuid4().hex[:6]}", b"x")
    assert not isinstance(err.value, PreconditionFailed)
    assert proxy.stats["requests"] == 2  # the first attempt and one retry
    assert ("SlowDown" if mode == "503" else "127.0.0.1") in str(err.value)
