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
