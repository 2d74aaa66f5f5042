"""Multipart uploads and ranged, parallel downloads of files larger than a part."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.storage import S3Store, Store

MiB = 1024 * 1024
SIZE = 21 * MiB  # 5 parts of 5 MiB: four full, one of 1 MiB


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("big") / "big.bin"
    data = os.urandom(SIZE)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


@pytest.mark.parametrize("kind", ["local", "moto", "seaweedfs"])
def test_multipart_upload_and_ranged_download(
    kind: str,
    store_factory: Callable[..., Store],
    s3_client: Callable[[str], object],
    big_file: tuple[Path, str],
    tmp_path: Path,
) -> None:
    src, digest = big_file
    store = store_factory(kind)
    ranges: list[str] = []
    threads: set[str] = set()
    if isinstance(store, S3Store):
        lock = threading.Lock()

        def record(params: dict, **_: object) -> None:
            with lock:
                ranges.append(params.get("Range", ""))
                threads.add(threading.current_thread().name)

        store.client.meta.events.register("provide-client-params.s3.GetObject", record)

    store.put_file(src, "snap/model.safetensors")
    assert store.size("snap/model.safetensors") == SIZE
    if isinstance(store, S3Store):
        c = store.config
        head = s3_client(c.endpoint_url).head_object(Bucket=c.bucket, Key=f"{c.prefix}/snap/model.safetensors")
        assert head["ETag"].strip('"').endswith("-5"), head["ETag"]  # a 5-part multipart upload

    dest = tmp_path / "dl" / "model.safetensors"
    store.get_file("snap/model.safetensors", dest)
    assert dest.stat().st_size == SIZE and sha256(dest) == digest
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.safetensors"]
    if isinstance(store, S3Store):
        assert len(ranges) == 5 and all(r.startswith("bytes=") for r in ranges), ranges
        assert "bytes=0-5242879" in ranges
        assert len(threads) > 1  # ranges fetched by several transfer threads
