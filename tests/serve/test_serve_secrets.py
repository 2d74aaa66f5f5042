"""S3 credentials of the server's environment never reach a hot-load's API reply, the server's log
or the hot-load client's error, even when the store's endpoint echoes the signed request back."""

from __future__ import annotations

import json
import logging

import pytest

from posttrain.inference.contract import HotLoadFailed
from tests.support.s3 import PLANTED_KEY_ID, PLANTED_SESSION_TOKEN, EchoEndpoint, assert_no_planted
from tests.support.serving import Api


@pytest.mark.parametrize("status", [403, 500])
def test_a_store_echoing_credentials_leaks_nothing(make_server, make_client, chain, echo_endpoint: EchoEndpoint,
                                                   status: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    echo_endpoint.status = status
    options = {"endpoint_url": echo_endpoint.url, "region": "us-east-1", "max_attempts": 1,
               "addressing_style": "path", "outage_retry_s": 0}
    server = make_server(store="s3://bucket", store_options=options)
    client = make_client(server)
    with pytest.raises(HotLoadFailed) as err:
        client.hot_load(chain.full)
    ops = Api(server.url).ops()
    (op,) = ops
    message = " ".join(c["message"] for c in op["status"]["conditions"])
    # the capture worked: the store's error, with the echoed headers, is in the condition and the log
    assert "echoed request headers" in message and "Authorization: AWS4-HMAC-SHA256 ***" in message
    assert "echoed request headers" in caplog.text
    assert PLANTED_KEY_ID in "".join(echo_endpoint.seen) and PLANTED_SESSION_TOKEN in "".join(echo_endpoint.seen)
    for text in (json.dumps(ops), caplog.text, str(err.value), err.value.reason):
        assert_no_planted(text)
