"""Credentials never show up in reprs, URIs, validation errors or request errors."""

from __future__ import annotations

import logging
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest

from posttrain.storage import InvalidURI, S3Store, S3StoreConfig, StorageError, open_store
from tests.support.s3 import PLANTED_KEY_ID, PLANTED_SESSION_TOKEN, EchoEndpoint, assert_no_planted

SECRET = "SECRET-planted-xyz"
KEY_ID = "AKIA-planted-id"
TOKEN = "TOKEN-planted-tok"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def assert_clean(text: str) -> None:
    for planted in (SECRET, KEY_ID, TOKEN):
        assert planted not in text


def planted_config(endpoint: str, **overrides: object) -> S3StoreConfig:
    fields: dict[str, object] = dict(
        bucket="bucket",
        prefix="p",
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id=KEY_ID,
        secret_access_key=SECRET,
        session_token=TOKEN,
        max_attempts=2,
        outage_retry_s=0,  # the errors themselves, not the ride through an outage (tests/storage/test_outage.py)
        connect_timeout=1,
    )
    fields.update(overrides)
    return S3StoreConfig(**fields)  # type: ignore[arg-type]


def test_config_and_store_text(tmp_path: Path) -> None:
    config = planted_config("http://127.0.0.1:9")
    store = S3Store(config)
    for text in (repr(config), str(config), config.model_dump_json(), str(config.model_dump()), repr(store), str(store)):
        assert_clean(text)
    assert config.secret_access_key is not None and config.secret_access_key.get_secret_value() == SECRET


def test_errors_from_a_closed_port(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    store = S3Store(planted_config(f"http://127.0.0.1:{closed_port()}"))
    (tmp_path / "f").write_bytes(b"x")
    calls: list[Callable[[], object]] = [
        lambda: store.put_bytes("k", b"x"),
        lambda: store.put_bytes("k", b"x", if_none_match=True),
        lambda: store.get_bytes("k"),
        lambda: store.exists("k"),
        lambda: store.size("k"),
        lambda: store.put_file(tmp_path / "f", "k"),
        lambda: store.get_file("k", tmp_path / "out"),
        lambda: list(store.list("")),
        lambda: store.delete(["k"]),
    ]
    for call in calls:
        with pytest.raises(StorageError) as err:
            call()
        assert "s3://bucket/p" in str(err.value) and "127.0.0.1" in str(err.value)
        assert_clean("".join(traceback.format_exception(err.value)))
    # botocore's own DEBUG records show request headers (the key id and session token
    # in them, never the secret key); nothing at INFO or above names any of them
    assert SECRET not in "\n".join(r.getMessage() for r in caplog.records)
    assert_clean("\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO))


def test_errors_from_a_live_server(moto_endpoint: str) -> None:
    store = S3Store(planted_config(moto_endpoint, bucket="no-such-bucket"))
    with pytest.raises(StorageError, match="does not exist") as err:
        store.get_bytes("k")
    assert_clean("".join(traceback.format_exception(err.value)))


def test_validation_errors_do_not_echo_secrets() -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        S3StoreConfig(bucket="bucket", secret_key=SECRET)  # type: ignore[call-arg] - a typo
    assert_clean(str(err.value))
    with pytest.raises(pydantic.ValidationError) as err:
        S3StoreConfig(bucket="bucket", secret_access_key=SECRET)  # without the key id
    assert_clean(str(err.value))
    with pytest.raises(InvalidURI) as err2:
        open_store("s3://bucket/p", secret_key=SECRET)
    assert_clean(str(err2.value)) and "secret_key" in str(err2.value)
    with pytest.raises(InvalidURI) as err2:
        open_store(f"s3://{KEY_ID}:{SECRET}@bucket/p")
    assert_clean(str(err2.value)) and "no credentials in the URI" in str(err2.value)


# ---------------------------------------------------------------- credentials from the environment, echoed back


@pytest.mark.parametrize(("status", "xml"), [(403, True), (403, False), (500, True), (500, False)])
def test_credentials_from_the_environment_echoed_by_the_endpoint_never_show(
    echo_endpoint: EchoEndpoint, status: int, xml: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    echo_endpoint.status, echo_endpoint.xml = status, xml
    store = open_store("s3://bucket/p", endpoint_url=echo_endpoint.url, region="us-east-1", max_attempts=2,
                       addressing_style="path", outage_retry_s=0)
    (tmp_path / "f").write_bytes(b"x")
    for call in (lambda: store.get_bytes("k"), lambda: store.put_bytes("k", b"x"),
                 lambda: store.put_file(tmp_path / "f", "k"), lambda: store.get_file("k", tmp_path / "o")):
        with pytest.raises(StorageError) as err:
            call()
        shown = "".join(traceback.format_exception(err.value))
        assert "s3://bucket/p" in shown  # the capture worked: the error names the object
        assert_no_planted(shown)
        assert_no_planted(str(err.value.__cause__))  # the cause is kept (retries read it), scrubbed
    # positive controls: the endpoint got the key id and token, and echoed them
    assert PLANTED_KEY_ID in "".join(echo_endpoint.seen) and PLANTED_SESSION_TOKEN in "".join(echo_endpoint.seen)
    if xml:
        assert "echoed request headers" in str(err.value) and "Authorization: AWS4-HMAC-SHA256 ***" in str(err.value)
    assert_no_planted(caplog.text)


def test_endpoint_userinfo_never_shows(tmp_path: Path) -> None:
    endpoint = f"http://{KEY_ID}:{SECRET}@127.0.0.1:{closed_port()}"
    store = open_store("s3://bucket/p", endpoint_url=endpoint, region="us-east-1", max_attempts=1,
                       access_key_id="k" * 8, secret_access_key="s" * 8, outage_retry_s=0)
    with pytest.raises(StorageError) as err:
        store.get_bytes("k")
    shown = "".join(traceback.format_exception(err.value))
    assert "http://***@127.0.0.1" in str(err.value)  # the capture worked
    assert_clean(shown + repr(store))


def test_redact_scrubs_remembered_values_env_credentials_and_userinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain import redact

    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    redact.remember("remembered-value-1", None, "")
    text = redact.scrub(f"a {TOKEN} b remembered-value-1 c https://u:p@h/x d postgres://me@db e ok")
    assert text == "a *** b *** c https://***@h/x d postgres://***@db e ok"
    assert redact.scrub("key%2Bwith%2Fplus", extra=["key+with/plus"]) == "***"  # the URL-encoded form too
    assert redact.scrub("pytest", extra=["test"]) == "pytest"  # too short to be told from a word
