"""The reference server's limits: request bodies (whatever the headers claim), JSON nesting, page
tokens, identities that end in a newline, and the tokens one completions request may ask for."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest

from posttrain.serve.server import MAX_BODY_BYTES
from tests.support.serving import DEPLOYMENT, PROMPT, TOKEN, Api, start_server

API = "/v1alpha1/inference/hotLoads"


@pytest.fixture(scope="module")
def server(chain, tmp_path_factory):
    s = start_server(chain, tmp_path_factory.mktemp("work"), max_request_tokens=4096)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def api(server):
    return Api(server.url)


def _raw(server, head: str, body: bytes = b"", *, close_write: bool = False) -> tuple[int, dict]:
    """Send a hand-made request; (status, JSON reply)."""
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    reply = rest.split(b"\r\n\r\n", 1)[1]
    return int(status_line.split()[1]), json.loads(reply)


def _head(extra: str) -> str:
    return (f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\n"
            f"Content-Type: application/json\nConnection: close\n{extra}\n")


@pytest.mark.parametrize("length", ["-1", "+5", "1e3", "0x10", "99999999999999999999999"])
def test_a_content_length_that_is_not_a_byte_count_is_refused(server, api, length):
    status, reply = _raw(server, _head(f"Content-Length: {length}"), b"x" * 1000)
    assert status in (400, 413), reply
    assert "Content-Length" in reply["error"]["message"]
    assert api.get("/health").status_code == 200


def test_a_content_length_over_the_limit_is_refused_before_reading(server):
    status, reply = _raw(server, _head(f"Content-Length: {MAX_BODY_BYTES + 1}"))
    assert status == 413 and str(MAX_BODY_BYTES) in reply["error"]["message"]


def test_a_chunked_body_is_read_up_to_the_limit(server):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    chunked = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:10], body[10:])) + b"0\r\n\r\n"
    status, reply = _raw(server, _head("Transfer-Encoding: chunked"), chunked)
    assert status == 200 and len(reply["choices"][0]["token_ids"]) == 2
    # a chunk that would pass the limit is refused before its bytes are read
    status, reply = _raw(server, _head("Transfer-Encoding: chunked"), f"{MAX_BODY_BYTES + 1:x}\r\n".encode())
    assert status == 413 and "chunked" in reply["error"]["message"]


def test_a_body_shorter_than_its_content_length_is_refused(server):
    status, reply = _raw(server, _head("Content-Length: 100"), b'{"model": ', close_write=True)
    assert status == 400 and "ended after 10 of 100 bytes" in reply["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", API])
def test_deeply_nested_json_is_a_400(api, path):
    r = api.session.post(api.url + path, data=b"[" * 100_000 + b"]" * 100_000, headers=api.headers, timeout=30)
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.text


@pytest.mark.parametrize("token", ["eyJrIjogImxpc3QiLCAicyI6ICIiLCAibyI6IDFlOTk5fQ", "1e999", "W1tbW1tbW10"])
def test_a_page_token_holding_garbage_is_a_400(api, token):
    # the first: base64 of {"k": "list", "s": "", "o": 1e999}
    r = api.get(API, params={"pageToken": token})
    assert r.status_code == 400, r.text
    assert "pageToken" in r.json()["message"]


@pytest.mark.parametrize("field", ["identity", "hotLoadId"])
def test_identities_ending_in_a_newline_are_refused(api, chain, field):
    body = {"deploymentId": DEPLOYMENT, "identity": chain.full, "type": "SNAPSHOT_TYPE_FULL"}
    body[field] = (body.get(field) or "op-1") + "\n"
    r = api.post(API, json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["message"]
    assert api.stats()["creates"] == {}


def test_check_identity_matches_in_full():
    from posttrain.chain.errors import FormatError
    from posttrain.chain.format import check_identity

    assert check_identity("run-1.step_2", "identity") == "run-1.step_2"
    for bad in ("abc\n", "abc\r\n", "\nabc", "a/b"):
        with pytest.raises(FormatError):
            check_identity(bad, "identity")


def test_prompts_times_n_times_max_tokens_is_bounded(api):
    many = {"model": "tiny", "prompt": [PROMPT] * 5000, "n": 64, "max_tokens": 16}
    r = api.post("/v1/completions", json=many)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "max_request_tokens" in error["message"] and "4096" in error["message"]
    # the default max_tokens counts too; a request under the limit is served
    assert api.post("/v1/completions", json={**many, "prompt": [PROMPT] * 300, "n": 1,
                                              "max_tokens": None}).status_code == 400
    assert len(api.complete(prompt=[PROMPT] * 4, n=2, max_tokens=4)["choices"]) == 8
