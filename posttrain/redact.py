"""Scrubbing secrets out of text: the one place every message, log record and API reply goes
through before it leaves posttrain. Imports nothing of posttrain.

What is scrubbed (replaced by ``***``):

- every value handed to ``remember`` (S3 credentials from a store's config or resolved from its
  profile, a job's ``secrets:`` values read at submit time), also in its URL-encoded form;
- the S3 credentials of this process's environment (``S3_ENV``), read at each call;
- the userinfo of every URL (``http://user:pw@host`` -> ``http://***@host``; see ``URL_USERINFO``);
- the value of a URL's query parameter whose name reads as a credential's (``?sig=...``,
  ``X-Amz-Signature=...``, ``api_key=...``: ``secret_name``, ``QUERY_SECRETS``);
- the value of a connection string's credential key (``AccountKey=...;``, ``Password=...``:
  ``CONNECTION_KEYS``);
- the credentials of an HTTP ``Authorization:`` header (``Authorization: Bearer ***``: ``AUTHORIZATION``);
- the value of a password-like key (``PASSWORD_KEY``) in JSON or a Python dict's text
  (``"password": "***"``) and in YAML (``password: ***``).

What reads as a credential (``secret_name``, ``credential_in``) is decided here too, so that what
refuses a credential (a job's plain ``env``, a block's URL) and what masks one agree.

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
# A URL (to its first blank or quote), and one query parameter of it: name=value.
URL = re.compile(r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s'\"<>]+")
QUERY_PARAM = re.compile(r"([?&;])([^=&#?;\s]+)=([^&#;\s]*)")
# Query parameters that carry a credential although secret_name does not read them as one: signed
# URLs' signatures (an Azure SAS's sig, S3's X-Amz-Signature, Google's X-Goog-Signature).
QUERY_SECRETS = frozenset({"SIG", "SIGNATURE", "X_AMZ_SIGNATURE", "X_GOOG_SIGNATURE"})
# Keys of a connection string (``Key=value;Key=value``: Azure storage and Service Bus, ADO.NET, ODBC)
# whose value is a credential.
CONNECTION_KEYS = ("AccountKey", "SharedAccessKey", "SharedAccessSignature", "Password", "Pwd", "AccessKey",
                   "SecretKey", "SecretAccessKey", "ApiKey", "ClientSecret", "Token")
CONNECTION_SECRET = re.compile(
    r"(?i)((?:^|(?<=[;\s'\"]))(?:{})\s*=\s*)([^;\s'\"]+)".format(
        "|".join(sorted(CONNECTION_KEYS, key=len, reverse=True)))
)
# An HTTP Authorization (or Proxy-Authorization) header, as a header line, a curl -H, or a dict's
# text ('Authorization': 'Bearer ...'): its credentials after the scheme (Bearer, Basic, token, ...).
AUTHORIZATION = re.compile(
    r"""(?i)(\bauthorization["']?\s*[:=]\s*["']?(?:(?:bearer|basic|token|digest|negotiate|aws4-hmac-sha256)\s+)?)"""
    r"""([^\s'"]+(?:[ \t]+[^\s'"]+=[^\s'"]+)*)""")
# Keys whose value is a password or a secret, by their ending (password, db_password, PGPASSWORD,
# client_secret, api_key, access_token); not a bare "token" or "key" (a logprob's "token", an
# artifact's "key") nor max_tokens.
PASSWORD_KEY = (r"[\w.-]*?(?:password|passwd|passphrase|secret|api[_-]?key|access[_-]?key|secret[_-]?key|"
                r"private[_-]?key|account[_-]?key|(?:access|auth|api|bearer|refresh|session|id)[_-]?token)")
# "password": "..." in JSON ('password': '...' in a Python dict's text): the quoted value.
JSON_SECRET = re.compile(rf"""(?i)(["']{PASSWORD_KEY}["']\s*:\s*)(["'])((?:\\.|(?!\2)[^\\\n])+)\2""")
# password: ... in YAML (a block mapping's line, maybe a list item's first key): the rest of the line
# but a trailing comment; a quoted value keeps its quotes. null, ~ and an empty value are left.
YAML_SECRET = re.compile(
    rf"""(?im)^([ \t]*(?:-[ \t]+)?{PASSWORD_KEY}[ \t]*:[ \t]+)"""
    r"""(?!(?:null|~|\*\*\*)[ \t]*(?:#|$))("[^"\n]*"|'[^'\n]*'|[^\s#'"][^\n]*?)(?=[ \t]+#|[ \t]*$)""")

# Words that mark a variable as a credential when a segment of its name (split at "_") is made of
# them: DB_PASS, GITHUB_PAT, GH_AUTH, SSH_PRIVATEKEY, API_CREDENTIAL, HF_TOKEN, AWS_SECRET_ACCESS_KEY,
# WANDB_API_KEY, MYSQL_PWD; not PATH, KEYBOARD_LAYOUT, TOKENIZERS_PARALLELISM or GIT_AUTHOR_NAME (PAT, KEY,
# TOKEN and AUTH there are only the start of a longer word).
SECRET_WORDS = frozenset(
    {"PASS", "PASSWORD", "PASSWD", "PWD", "PASSPHRASE", "PAT", "AUTH", "PRIVATE", "CREDENTIAL", "CREDENTIALS",
     "TOKEN", "TOKENS", "SECRET", "SECRETS", "KEY", "KEYS"}
)  # fmt: skip
# Words that may stand before a secret word inside one segment (APIKEY, ACCESSKEY, DBPASS, ...).
SECRET_PREFIX_WORDS = frozenset({"API", "ACCESS", "AUTH", "PRIVATE", "SSH", "DB", "CLIENT", "SESSION", "BEARER",
                                 "OAUTH", "SIGNING", "ENCRYPTION", "MASTER", "ROOT", "ADMIN", "USER", "APP"})
_SEGMENT = re.compile(
    "(?:{0})*(?:{1})(?:{0}|{1})*".format(
        "|".join(sorted(SECRET_PREFIX_WORDS, key=len, reverse=True)),
        "|".join(sorted(SECRET_WORDS, key=len, reverse=True)),
    )
)
# Endings that mark a segment as a credential whatever word is glued before them (PGPASSWORD,
# GITHUBTOKEN, STRIPEAPIKEY). Not the short words: MONKEY, COMPASS, COMPAT and OLDPWD end in them.
SECRET_ENDINGS = ("PASSWORD", "PASSWORDS", "PASSWD", "PASSPHRASE", "TOKEN", "SECRET", "SECRETS", "CREDENTIAL",
                  "CREDENTIALS", "APIKEY", "ACCESSKEY", "SECRETKEY", "PRIVATEKEY", "ACCOUNTKEY")
# A connection string holds its credentials inside (AZURE_STORAGE_CONNECTION_STRING, DB_CONNSTR,
# SERVICEBUS_CONNECTIONSTRING): the name alone says it carries one.
CONNECTION_STRING_NAME = re.compile(r"(?:^|_)CONN(?:ECTION)?_?STR(?:ING)?S?(?:_|$)")
# Names the rules above would take for credentials: the shell's working folder.
NOT_SECRET = frozenset({"PWD"})

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
    out = URL_USERINFO.sub(rf"\1{MASK}@", out)
    out = URL.sub(_mask_query, out)
    out = AUTHORIZATION.sub(rf"\1{MASK}", out)
    out = JSON_SECRET.sub(rf"\1\2{MASK}\2", out)
    out = YAML_SECRET.sub(_mask_yaml, out)
    return CONNECTION_SECRET.sub(rf"\1{MASK}", out)


def _mask_yaml(found: re.Match) -> str:
    value = found[2]
    quote = value[0] if value[0] in "'\"" else ""
    return f"{found[1]}{quote}{MASK}{quote}"


def secret_name(name: str) -> bool:
    """Whether ``name`` (a variable's, a query parameter's: "-" and "." count as "_") reads as a
    credential's name (see ``SECRET_WORDS``, ``SECRET_ENDINGS`` and ``CONNECTION_STRING_NAME``)."""
    upper = re.sub(r"[-.]", "_", name.upper())
    if upper in NOT_SECRET:
        return False
    if CONNECTION_STRING_NAME.search(upper):
        return True
    return any(_SEGMENT.fullmatch(part) or part.endswith(SECRET_ENDINGS) for part in upper.split("_") if part)


def _secret_param(name: str) -> bool:
    # NOT_SECRET's PWD is the shell's working folder; in a URL's query, pwd= is a password
    upper = re.sub(r"[-.]", "_", name.upper())
    return secret_name(name) or upper in QUERY_SECRETS or upper in NOT_SECRET


def _mask_query(url: re.Match) -> str:
    return QUERY_PARAM.sub(lambda m: f"{m[1]}{m[2]}={MASK}" if m[3] and _secret_param(m[2]) else m[0], url[0])


def credential_in(value: str) -> str | None:
    """Why ``value`` holds a credential (for a message: it names no secret), or None: a URL with a
    user or password, a URL query parameter named as a credential, a connection string's
    credential key (``AccountKey=``, ``Password=``, ...)."""
    if has_userinfo(value):
        return "a URL with a user or password"
    found = CONNECTION_SECRET.search(value)
    if found:
        return f"a connection string with {found[1].split('=')[0].strip()}="
    for url in URL.finditer(value):
        names = [m[2] for m in QUERY_PARAM.finditer(url[0]) if m[3] and _secret_param(m[2])]
        if names:
            return f"a URL whose query parameter {names[0]} carries a credential"
    return None


def no_credentials(value: str | None, instead: str) -> str | None:
    """``value`` (a URL field of a block or setting, stored and shown in clear), or a ``ValueError``
    saying what credential it holds and ``instead`` (where the credential goes), never the value."""
    if value is not None and (found := credential_in(value)) is not None:
        raise ValueError(f"holds {found}; this field is stored and shown in clear, so it takes no credential: "
                         f"{instead}")
    return value


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


__all__ = ["MASK", "S3_ENV", "LogFilter", "credential_in", "has_userinfo", "logger", "no_credentials", "remember",
           "scrub", "scrub_exception", "secret_name"]
