"""posttrain.redact: a URL's whole userinfo is masked, whatever its password holds."""

from __future__ import annotations

import pytest

from posttrain import redact


@pytest.mark.parametrize(("text", "scrubbed"), [
    ("postgresql://app:pa/ss@db/x", "postgresql://***@db/x"),  # "/" in the password
    ("https://u:pa#ss@host/x", "https://***@host/x"),  # "#"
    ("https://u:p@ssw0rd@host/x", "https://***@host/x"),  # "@"
    ("https://u:pa?ss@host/x?q=1", "https://***@host/x?q=1"),  # "?"
    ("https://u:a/b#c@d?e@host:8443/x y", "https://***@host:8443/x y"),  # all of them
    ("see postgresql://app:pa/ss@db/x, then retry", "see postgresql://***@db/x, then retry"),
    ("'https://u:pa#ss@host/x'", "'https://***@host/x'"),
])
def test_the_whole_password_of_a_url_is_masked(text: str, scrubbed: str) -> None:
    assert redact.scrub(text) == scrubbed
    assert redact.has_userinfo(text)


@pytest.mark.parametrize("text", ["https://host/x@y", "http://127.0.0.1:8000/v1/models: refused",
                                  "https://host/a?mail=a@b.com", "s3://bucket/key@v2"])
def test_a_url_without_userinfo_is_left_as_it_is(text: str) -> None:
    assert redact.scrub(text) == text
    assert not redact.has_userinfo(text)


@pytest.mark.parametrize(("text", "scrubbed", "why"), [
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=k3y+/AbC==;EndpointSuffix=core.windows.net",
     "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***;EndpointSuffix=core.windows.net", "AccountKey="),
    ("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=root;SharedAccessKey=abcdef123",
     "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=root;SharedAccessKey=***", "SharedAccessKey="),
    ("Server=db;User Id=sa;Password=hunter22;", "Server=db;User Id=sa;Password=***;", "Password="),
    ("https://acct.blob.core.windows.net/c?sv=2022-11-02&sig=AbC%2Fdef&se=2030",
     "https://acct.blob.core.windows.net/c?sv=2022-11-02&sig=***&se=2030", "query parameter sig"),
    ("GET https://b.s3.x/k?X-Amz-Credential=AKIA1%2F2&X-Amz-Signature=0a1b2c failed",
     "GET https://b.s3.x/k?X-Amz-Credential=***&X-Amz-Signature=*** failed", "query parameter X-Amz-Credential"),
    ("http://gw:8000/v1?api_key=xyz123", "http://gw:8000/v1?api_key=***", "query parameter api_key"),
    ("https://h/x?user=a&pwd=hunter22222", "https://h/x?user=a&pwd=***", "query parameter pwd"),  # not the shell's PWD
])  # fmt: skip
def test_credentials_in_connection_strings_and_queries_are_found_and_masked(text: str, scrubbed: str,
                                                                           why: str) -> None:
    assert redact.scrub(text) == scrubbed
    assert why in redact.credential_in(text)


@pytest.mark.parametrize("text", ["https://host/v1?page=2&q=a", "max_tokens=16", "AccountName=acct;EndpointSuffix=x",
                                  "http://127.0.0.1:8000/v1/models"])
def test_values_without_credentials_are_left_as_they_are(text: str) -> None:
    assert redact.scrub(text) == text
    assert redact.credential_in(text) is None


@pytest.mark.parametrize(("text", "scrubbed"), [
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "Authorization: Bearer ***"),
    ("curl -H 'Authorization: Bearer hf_abcdef123' http://gw/v1", "curl -H 'Authorization: Bearer ***' http://gw/v1"),
    ("headers={'Authorization': 'Bearer sk-live-123456'}", "headers={'Authorization': 'Bearer ***'}"),
    ('{"Authorization": "Basic dXNlcjpwYXNz"}', '{"Authorization": "Basic ***"}'),
    ("proxy-authorization: token ghp_0123456789", "proxy-authorization: token ***"),
    ('{"user": "app", "password": "hunter2"}', '{"user": "app", "password": "***"}'),
    ('{"db_password":"p\\"q w"}', '{"db_password":"***"}'),  # an escaped quote and a blank inside
    ("{'client_secret': 'abc123', 'region': 'x'}", "{'client_secret': '***', 'region': 'x'}"),
    ('"api_key" : "xyz"', '"api_key" : "***"'),
    ("db:\n  user: app\n  password: hunter2 with blanks\n  port: 5432",
     "db:\n  user: app\n  password: ***\n  port: 5432"),
    ("password: 'hunter2'  # the site's\nPGPASSWORD: \"x y\"", "password: '***'  # the site's\nPGPASSWORD: \"***\""),
    ("- access_token: abc.def\n- name: x", "- access_token: ***\n- name: x"),
])  # fmt: skip
def test_authorization_headers_and_passwords_in_json_and_yaml_are_masked(text: str, scrubbed: str) -> None:
    assert redact.scrub(text) == scrubbed
    assert redact.scrub(scrubbed) == scrubbed


@pytest.mark.parametrize("text", [
    '{"token": "hello", "logprob": -0.1}', "eval_max_tokens: 6", '{"max_tokens": 16, "key": "runs/x"}',
    "password: null", "password:", "secret_ref: {name: x}", "an authorization error", "tokenizer: /models/x",
])  # fmt: skip
def test_json_and_yaml_without_credentials_are_left_as_they_are(text: str) -> None:
    assert redact.scrub(text) == text
