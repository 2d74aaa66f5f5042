"""open_store: URIs to stores, and clear errors naming a bad URI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.storage import InvalidURI, LocalStore, S3Store, open_store

MiB = 1024 * 1024


def test_s3_uris() -> None:
    store = open_store("s3://my-bucket/runs/2026-11-30", endpoint_url="http://127.0.0.1:9", part_size=8 * MiB)
    assert isinstance(store, S3Store)
    assert (store.config.bucket, store.config.prefix, store.config.part_size) == ("my-bucket", "runs/2026-11-30", 8 * MiB)
    assert store.uri == "s3://my-bucket/runs/2026-11-30"
    for uri in ("s3://my-bucket", "s3://my-bucket/"):
        s = open_store(uri)
        assert isinstance(s, S3Store) and s.config.prefix == "" and s.uri == "s3://my-bucket"
    defaults = open_store("s3://my-bucket").config
    assert defaults.part_size == 64 * MiB and defaults.max_concurrency == 8
    assert defaults.request_checksum_calculation == "when_required"
    assert (defaults.retry_mode, defaults.max_attempts) == ("standard", 8)


def test_local_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for uri in (str(tmp_path / "a"), tmp_path / "a", (tmp_path / "a").as_uri(), f"file://localhost{tmp_path}/a"):
        store = open_store(uri)
        assert isinstance(store, LocalStore) and store.root == tmp_path / "a"
    monkeypatch.chdir(tmp_path)
    store = open_store("rel/store")
    assert isinstance(store, LocalStore) and store.root == tmp_path / "rel" / "store"
    assert open_store(f"file://{tmp_path}/with%20space").root == tmp_path / "with space"


@pytest.mark.parametrize(
    "uri,options,expected",
    [
        ("", {}, "empty"),
        ("s3://", {}, "no bucket"),
        ("s3:///prefix", {}, "no bucket"),
        ("s3://Bad_Bucket/x", {}, "bucket"),
        ("s3://ok-bucket/a//b", {}, "prefix"),
        ("s3://ok-bucket/a/../b", {}, "prefix"),
        ("s3://ok-bucket/x?versionId=1", {}, "'?' or '#'"),
        ("s3://ok-bucket/x", {"bogus": 1}, "bogus"),
        ("s3://ok-bucket/x", {"part_size": 1024}, "part_size"),
        ("s3://ok-bucket/x", {"bucket": "other"}, "comes from the URI"),
        ("gs://bucket/x", {}, "unsupported scheme 'gs'"),
        ("https://host/x", {}, "unsupported scheme 'https'"),
        ("file://otherhost/x", {}, "name no host"),
        ("/tmp/x", {"region": "us-east-1"}, "s3:// stores only"),
    ],
)
def test_bad_uris_are_named(uri: str, options: dict, expected: str) -> None:
    with pytest.raises(InvalidURI) as err:
        open_store(uri, **options)
    assert expected in str(err.value) and repr(uri) in str(err.value)


def test_endpoint_from_environment(moto_bucket: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, bucket = moto_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with open_store(f"s3://{bucket}/env-test", addressing_style="path") as store:
        assert store.put_bytes("k", b"v")
        assert store.get_bytes("k")[0] == b"v"
    assert os.environ["AWS_ENDPOINT_URL_S3"] == endpoint
