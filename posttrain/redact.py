"""Scrubbing secrets out of text: the one place every message, log record and API reply goes
through before it leaves posttrain. Imports nothing of posttrain.

What is scrubbed (replaced by ``***``):

- every value handed to ``remember`` (S3 credentials from a store's config or resolved from its
  profile, a job's ``secrets:`` values read at submit time), also in its URL-encoded form;
- the S3 credentials of this process's environment (``S3_ENV``), read at each call;
- the userinfo of every URL (``http://user:pw@host`` -> ``http://***@host``; see ``URL_USERINFO``).

``scrub_exception`` rewrites, in place, the messages of an exception and of the exceptions it was
raised from, so a traceback printed or logged later shows no secret either (the chain itself is
kept: retries are decided from it). ``LogFilter`` scrubs a log record (message and traceback).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable
from urllib.parse import quote

MASK = "***"
# S3 credentials boto3 reads from the environment.
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
# Shorter values would mask ordinary words in messages and paths ("test" in "pytest"). Real
# credentials are longer (AWS key ids 20 characters, secret keys 40); a shorter one is not scrubbed.
MIN_LENGTH = 8
# A URL's userinfo: everything from "scheme://" to the last "@" before the host. A password may hold
# "/", "#", "?" or "@" unencoded (postgresql://app:pa/ss@db/x, https://u:p@ss@host): once a ":" follows
# the user, the userinfo runs to the URL's last "@" (an "@" in a path after a port is masked with it:
# more than needed, never less); a user alone ends at the first "/", "?" or "#".
URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)(?:[^/?#\s@'\"]*:[^\s'\"]*|[^/?#\s'\"]+)@")

_known: set[str] = set()
_lock = threading.Lock()


def remember(*values: str | None) -> None:
    """Scrub these values from now on (in this process)."""
    with _lock:
        for value in values:
            if isinstance(value, str) and len(value) >= MIN_LENGTH:
                _known.add(value)


def _secrets(extra: Iterable[str | None]) -> list[str]:
    with _lock:
        found = set(_known)
    found.update(v for name in S3_ENV if len(v := os.environ.get(name, "")) >= MIN_LENGTH)
    found.update(v for v in extra if isinstance(v, str) and len(v) >= MIN_LENGTH)
    found |= {encoded for v in list(found) if (encoded := quote(v, safe="")) != v}
    return sorted(found, key=len, reverse=True)  # a secret inside a longer one goes with the longer


def scrub(text: object, extra: Iterable[str | None] = ()) -> str:
    """``text`` (made a string) with every known secret and every URL's userinfo replaced by ``***``."""
    out = str(text)
    for secret in _secrets(extra):
        if secret in out:
            out = out.replace(secret, MASK)
    return URL_USERINFO.sub(rf"\1{MASK}@", out)


def has_userinfo(value: str) -> bool:
    """Whether ``value`` holds a URL with a user (and maybe a password) before its host."""
    return URL_USERINFO.search(value) is not None


def scrub_exception(exc: BaseException, extra: Iterable[str | None] = ()) -> BaseException:
    """Scrub the message of ``exc`` and of every exception in its cause/context chain, in place;
    returns ``exc``."""
    extra = list(extra)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        try:
            text = str(current)
        except Exception:  # noqa: BLE001 - an exception whose str() fails shows nothing anyway
            text = ""
        clean = scrub(text, extra)
        if clean != text:
            current.args = (clean,)
            for attr in ("msg", "message", "strerror"):  # what some classes print instead of args
                if isinstance(getattr(current, attr, None), str):
                    try:
                        setattr(current, attr, scrub(getattr(current, attr), extra))
                    except (AttributeError, TypeError):
                        pass
            response = getattr(current, "response", None)  # botocore's ClientError keeps the reply
            error = response.get("Error") if isinstance(response, dict) else None
            if isinstance(error, dict) and isinstance(error.get("Message"), str):
                error["Message"] = scrub(error["Message"], extra)
        current = current.__cause__ or current.__context__
    return exc


class LogFilter(logging.Filter):
    """Scrubs a record's message and traceback; add it to a logger or a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string: leave the record to logging
            return True
        record.msg, record.args = scrub(message), None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


def logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with a ``LogFilter``: what it logs is scrubbed before any handler
    (a file, stderr, pytest's caplog) sees it."""
    log = logging.getLogger(name)
    if not any(isinstance(f, LogFilter) for f in log.filters):
        log.addFilter(LogFilter())
    return log


__all__ = ["MASK", "S3_ENV", "LogFilter", "has_userinfo", "logger", "remember", "scrub", "scrub_exception"]
