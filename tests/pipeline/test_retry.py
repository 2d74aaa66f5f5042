"""Which failures a Prefect task retries: decided by type (``is_transient``), never by class name.

No Prefect server: ``is_transient`` and ``transient_only`` are plain functions. The clients are
pointed at a port nothing listens on, so what they really raise is classified, not a hand-made copy.
"""

from __future__ import annotations

import socket

import botocore.exceptions as boto
import pytest
import requests

from posttrain.errors import TransientError
from posttrain.inference.contract import HotLoadAPIError, HotLoadFailed, HotLoadTimeout, HotLoadUnavailable
from posttrain.pipeline.tasks.retry import is_transient, transient_only
from posttrain.publish.publisher import PublishError
from posttrain.rollouts.client import CompletionsClient, CompletionsConfig, CompletionsError, CompletionsUnavailable
from posttrain.storage.errors import InvalidKey, InvalidURI, NotFound, PreconditionFailed, StorageError
from tests.support.serving import TOKEN


def _client_error(status: int, code: str) -> boto.ClientError:
    return boto.ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                            "GetObject")


def _raised_from(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as e:
            raise outer from e
    except BaseException as e:  # noqa: BLE001
        return e


@pytest.fixture
def dead_url() -> str:
    """An http URL on which nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


TRANSIENT = {
    "HotLoadUnavailable (connection)": HotLoadUnavailable("create hot-load: ConnectionError"),
    "HotLoadUnavailable 503": HotLoadUnavailable("HTTP 503", status=503, retry_after=1.0),
    "HotLoadTimeout": HotLoadTimeout("still RUNNING after 1800s"),
    "HotLoadAPIError 429": HotLoadAPIError("HTTP 429", status=429),
    "HotLoadAPIError 500": HotLoadAPIError("HTTP 500", status=500),
    "HotLoadAPIError 502": HotLoadAPIError("HTTP 502", status=502),
    "HotLoadAPIError 503": HotLoadAPIError("HTTP 503", status=503),
    "HotLoadAPIError 504": HotLoadAPIError("HTTP 504", status=504),
    "CompletionsUnavailable": CompletionsUnavailable("failed after 5 attempts (HTTP 503)"),
    "TransientError": TransientError("anything that says so"),
    "builtin ConnectionError": ConnectionError("reset"),
    "builtin ConnectionResetError": ConnectionResetError("reset by peer"),
    "builtin TimeoutError": TimeoutError("timed out"),
    "requests ConnectionError": requests.exceptions.ConnectionError("refused"),
    "requests Timeout": requests.exceptions.Timeout("slow"),
    "requests ReadTimeout": requests.exceptions.ReadTimeout("slow read"),
    "requests ConnectTimeout": requests.exceptions.ConnectTimeout("slow connect"),
    "botocore EndpointConnectionError": boto.EndpointConnectionError(endpoint_url="http://s3"),
    "botocore ConnectionClosedError": boto.ConnectionClosedError(endpoint_url="http://s3"),
    "botocore ReadTimeoutError": boto.ReadTimeoutError(endpoint_url="http://s3"),
    "botocore ConnectTimeoutError": boto.ConnectTimeoutError(endpoint_url="http://s3"),
    "botocore ClientError 503 SlowDown": _client_error(503, "SlowDown"),
    "botocore ClientError 500": _client_error(500, "InternalError"),
    "StorageError from EndpointConnectionError": _raised_from(
        StorageError("get s3://b/k: EndpointConnectionError"), boto.EndpointConnectionError(endpoint_url="http://s3")),
    "StorageError from ClientError 503": _raised_from(StorageError("put s3://b/k: SlowDown"),
                                                       _client_error(503, "SlowDown")),
    "PublishError from StorageError from ReadTimeoutError": _raised_from(
        PublishError("publishing failed"),
        _raised_from(StorageError("upload s3://b/k"), boto.ReadTimeoutError(endpoint_url="http://s3"))),
}

PERMANENT = {
    "ValueError": ValueError("bad settings"),
    "RuntimeError": RuntimeError("step 3 was not published"),
    "HotLoadFailed": HotLoadFailed("hot-load ended FAILED", operation_id="op", reason="corrupt delta"),
    "HotLoadAPIError 400": HotLoadAPIError("HTTP 400", status=400),
    "HotLoadAPIError 401": HotLoadAPIError("HTTP 401", status=401),
    "HotLoadAPIError 404": HotLoadAPIError("HTTP 404", status=404),
    "HotLoadAPIError malformed reply": HotLoadAPIError("the reply is not a JSON object"),
    "CompletionsError": CompletionsError("HTTP 401: unauthorized"),
    "requests HTTPError": requests.exceptions.HTTPError("404"),
    "botocore ClientError 403": _client_error(403, "AccessDenied"),
    "botocore NoCredentialsError": boto.NoCredentialsError(),
    "StorageError (no cause)": StorageError("delete in s3://b: 2 keys failed"),
    "StorageError from ClientError 403": _raised_from(StorageError("put s3://b/k: AccessDenied"),
                                                       _client_error(403, "AccessDenied")),
    "StorageError from ValueError": _raised_from(StorageError("get s3://b/k"), ValueError("bad")),
    "NotFound from a connection error": _raised_from(NotFound("s3://b/k: no such key"), ConnectionError("x")),
    "PreconditionFailed": PreconditionFailed("s3://b/k: precondition failed (412)"),
    "InvalidKey": InvalidKey("a//b: empty path segment"),
    "InvalidURI": InvalidURI("s4://x: unknown scheme"),
    "PublishError (no cause)": PublishError("step 3 is older than the published step 5"),
    "ValueError from a connection error": _raised_from(ValueError("bad identity"), ConnectionError("x")),
}


@pytest.mark.parametrize("exc", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_transient_failures_are_retried(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", PERMANENT.values(), ids=PERMANENT.keys())
def test_permanent_failures_are_not_retried(exc):
    assert not is_transient(exc)


@pytest.mark.parametrize("cls", [HotLoadUnavailable, HotLoadTimeout, CompletionsUnavailable])
def test_the_transient_errors_of_the_clients_carry_the_marker(cls):
    assert issubclass(cls, TransientError)


def test_the_decision_is_by_type_not_by_name():
    class Renamed(HotLoadUnavailable):  # a subclass under any name is still transient
        pass

    class ConnectionError(Exception):  # noqa: A001 - a look-alike name is not the builtin type
        pass

    class HotLoadTimeout(Exception):  # noqa: N818
        pass

    assert is_transient(Renamed("x"))
    assert not is_transient(ConnectionError("x"))
    assert not is_transient(HotLoadTimeout("x"))


def test_a_wrapped_transient_error_suppressed_with_from_none_is_not_retried():
    try:
        try:
            raise boto.EndpointConnectionError(endpoint_url="http://s3")
        except boto.EndpointConnectionError:
            raise StorageError("connect to s3://b: bad profile") from None
    except StorageError as e:
        assert not is_transient(e)


def test_what_the_hot_load_client_raises_for_an_unreachable_service_is_retried(dead_url):
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

    config = HotLoadConfig(api_url=dead_url, deployment_id="d", token=TOKEN, max_attempts=2, backoff_base=0,
                           request_timeout=5)
    with CoreWeaveHotLoader(config) as client, pytest.raises(HotLoadAPIError) as info:
        client.hot_load("step-1")
    assert isinstance(info.value, HotLoadUnavailable) and info.value.status is None
    assert "gave up after 2 attempts" in str(info.value)
    assert is_transient(info.value)


def test_what_the_completions_client_raises_for_an_unreachable_gateway_is_retried(dead_url):
    client = CompletionsClient(CompletionsConfig(gateway_url=dead_url, model="m", max_attempts=1, timeout_s=5))
    with pytest.raises(CompletionsUnavailable) as info:
        client.complete([1, 2], n=1, max_tokens=1, temperature=0, top_p=1)
    client.close()
    assert is_transient(info.value)


def test_what_the_s3_store_raises_for_an_unreachable_endpoint_is_retried(dead_url):
    from posttrain.storage.s3 import S3Store
    from posttrain.storage.s3config import S3StoreConfig

    store = S3Store(S3StoreConfig(bucket="bkt", endpoint_url=dead_url, region="us-east-1", max_attempts=1,
                                  access_key_id="AKIDEXAMPLE", secret_access_key="secret-example",
                                  connect_timeout=2, read_timeout=2, outage_retry_s=0))
    try:
        with pytest.raises(StorageError) as info:
            store.get_bytes("some/key")
    finally:
        store.close()
    assert not isinstance(info.value, NotFound)
    assert is_transient(info.value)


class _State:
    def __init__(self, exc: BaseException | None):
        self.exc = exc

    def result(self):
        if self.exc is not None:
            raise self.exc
        return 1


def test_transient_only_is_the_retry_condition_of_prefect_tasks():
    assert transient_only(None, None, _State(HotLoadTimeout("slow")))
    assert not transient_only(None, None, _State(HotLoadFailed("failed")))
    assert not transient_only(None, None, _State(None))  # a task that succeeded is not retried
