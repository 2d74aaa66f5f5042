"""Fixtures: moto in-process, a real SeaweedFS, and stores of each kind.

SeaweedFS: $POSTTRAIN_S3_ENDPOINT when set (CI starts scripts/services/start-s3.sh
first); otherwise this session starts one through that script on a free port and
stops it at the end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from posttrain.storage import LocalStore, S3Store, S3StoreConfig, Store

MiB = 1024 * 1024
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "services"
STORE_KINDS = ["local", "moto", "seaweedfs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_config(endpoint: str, bucket: str, **overrides: object) -> S3StoreConfig:
    """A config for the local test servers: any credentials, path-style, small parts."""
    fields: dict[str, object] = dict(
        bucket=bucket,
        prefix=f"t/{uuid.uuid4().hex[:10]}",
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id="test",
        secret_access_key="test",
        addressing_style="path",
        part_size=5 * MiB,
        max_concurrency=4,
        max_attempts=3,
    )
    fields.update(overrides)
    return S3StoreConfig(**fields)  # type: ignore[arg-type]


def raw_client(endpoint: str):  # noqa: ANN201 - a boto3 client
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=Config(s3={"addressing_style": "path"}),
    )


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    given = os.environ.get("POSTTRAIN_S3_ENDPOINT")
    if given:
        yield given.rstrip("/")
        return
    port = free_port()
    env = {
        **os.environ,
        "S3_PORT": str(port),
        "POSTTRAIN_S3_DIR": str(tmp_path_factory.mktemp("seaweedfs")),
        "POSTTRAIN_BIN_DIR": os.environ.get("POSTTRAIN_BIN_DIR", str(Path(sys.executable).parent)),
    }
    started = subprocess.run(
        ["bash", str(SCRIPTS / "start-s3.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    try:
        if started.returncode != 0:
            pytest.fail(f"start-s3.sh failed ({started.returncode}):\n{started.stdout}{started.stderr}")
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop-s3.sh")], env=env, capture_output=True, timeout=60)


def _session_bucket(endpoint: str) -> Iterator[str]:
    client = raw_client(endpoint)
    bucket = f"posttrain-test-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    yield bucket
    # leave nothing behind on a long-lived server
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    client.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="session")
def moto_bucket(moto_endpoint: str) -> Iterator[tuple[str, str]]:
    for bucket in _session_bucket(moto_endpoint):
        yield moto_endpoint, bucket


@pytest.fixture(scope="session")
def seaweedfs_bucket(seaweedfs_endpoint: str) -> Iterator[tuple[str, str]]:
    for bucket in _session_bucket(seaweedfs_endpoint):
        yield seaweedfs_endpoint, bucket


@pytest.fixture
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """``factory(kind, **config_overrides)``: a fresh, empty store of that kind ("local",
    "moto", "seaweedfs"); S3 ones get their own prefix in a session bucket."""
    made: list[Store] = []

    def factory(kind: str, **overrides: object) -> Store:
        if kind == "local":
            store: Store = LocalStore(tmp_path / f"store{len(made)}")
        else:
            endpoint, bucket = request.getfixturevalue(f"{kind}_bucket")
            store = S3Store(s3_config(endpoint, bucket, **overrides))
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, store_factory: Callable[..., Store]) -> Store:
    return store_factory(request.param)


@pytest.fixture(scope="session")
def s3_config_factory() -> Callable[..., S3StoreConfig]:
    """``s3_config_factory(endpoint, bucket, **overrides)``: see ``s3_config``."""
    return s3_config


@pytest.fixture(scope="session")
def s3_client() -> Callable[[str], object]:
    """``s3_client(endpoint)``: a plain boto3 client for checks behind the store's back."""
    return raw_client


# ---------------------------------------------------------------- an endpoint that echoes the request headers

PLANTED_KEY_ID = "AKIAPLANTEDKEYID0001"
PLANTED_SECRET = "planted/Secret+Access=Key0001"
PLANTED_SESSION_TOKEN = "planted-Session/Token+0001=="
PLANTED = (PLANTED_KEY_ID, PLANTED_SECRET, PLANTED_SESSION_TOKEN)


class EchoEndpoint:
    """An S3 "endpoint" on 127.0.0.1 answering every request with ``status`` and the request's
    headers in the body (an S3 XML error, or plain text with ``xml = False``); ``seen`` holds the
    headers of every request, to prove the credentials were sent."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from xml.sax.saxutils import escape

        endpoint = self
        self.status = 403
        self.xml = True
        self.seen: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                headers = "".join(f"{k}: {v}\n" for k, v in self.headers.items())
                endpoint.seen.append(headers)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                code = "AccessDenied" if endpoint.status == 403 else "InternalError"
                if endpoint.xml:
                    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                            f"<Message>echoed request headers: {escape(headers)}</Message></Error>").encode()
                else:
                    body = f"echoed request headers:\n{headers}".encode()
                self.send_response(endpoint.status)
                self.send_header("Content-Type", "application/xml" if endpoint.xml else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = answer

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def echo_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[EchoEndpoint]:
    """The echoing endpoint, with planted S3 credentials in the environment (the only ones:
    no profile is read)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", PLANTED_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", PLANTED_SESSION_TOKEN)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    endpoint = EchoEndpoint()
    yield endpoint
    endpoint.close()


def assert_no_planted(text: str) -> None:
    for planted in PLANTED:
        assert planted not in text
        assert quote(planted, safe="") not in text
