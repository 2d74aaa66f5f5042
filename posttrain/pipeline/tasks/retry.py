"""Which failures a task retries: transient ones only (network, timeouts, throttling), decided by type.

Transient are:

- ``posttrain.errors.TransientError`` and its subclasses (``HotLoadUnavailable``, ``HotLoadTimeout``,
  ``CompletionsUnavailable``);
- a ``HotLoadAPIError`` with HTTP status 429 or 5xx;
- the builtin ``ConnectionError`` and ``TimeoutError``, requests' ``ConnectionError`` and ``Timeout``,
  botocore's connection and timeout errors, and a botocore ``ClientError`` that throttles or is a 5xx;
- a ``StorageError`` (posttrain.storage wraps every boto3 error in one) or ``PublishError`` (the
  publisher wraps its background failures) whose cause is transient. ``NotFound``,
  ``PreconditionFailed``, ``InvalidKey`` and ``InvalidURI`` never are.

Everything else (bad settings, a failed hot-load, a 4xx, a corrupt snapshot) fails the task at once.
"""

from __future__ import annotations

import requests

from posttrain.errors import TransientError
from posttrain.inference.contract import HotLoadAPIError
from posttrain.publish.publisher import PublishError
from posttrain.storage.errors import InvalidKey, InvalidURI, NotFound, PreconditionFailed, StorageError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
THROTTLING_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                              "RequestLimitExceeded", "ServiceUnavailable", "InternalError"})
_BUILTIN = (TransientError, ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout)
_WRAPPERS = (StorageError, PublishError)
_NEVER = (NotFound, PreconditionFailed, InvalidKey, InvalidURI)


def is_transient(exc: BaseException) -> bool:
    """Whether repeating the task that raised ``exc`` may succeed (see the module docstring)."""
    if isinstance(exc, _NEVER):
        return False
    if isinstance(exc, _WRAPPERS):
        return any(_transient_itself(cause) for cause in _causes(exc))
    return _transient_itself(exc)


def _transient_itself(exc: BaseException) -> bool:
    if isinstance(exc, HotLoadAPIError):
        return isinstance(exc, TransientError) or exc.status in RETRY_STATUSES
    if isinstance(exc, _BUILTIN):
        return True
    return _botocore_transient(exc)


def _botocore_transient(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
        )
    except ImportError:  # no S3 support installed: nothing raised can be botocore's
        return False
    if isinstance(exc, (EndpointConnectionError, ConnectionClosedError, ReadTimeoutError, ConnectTimeoutError)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return status in RETRY_STATUSES or code in THROTTLING_CODES
    return False


def _causes(exc: BaseException):
    """The exceptions ``exc`` was raised from, nearest first, as a traceback prints them."""
    seen = {id(exc)}
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)


def transient_only(task, task_run, state) -> bool:
    """``retry_condition_fn`` for Prefect tasks."""
    try:
        state.result()
    except Exception as e:  # noqa: BLE001 - classifying, not handling
        return is_transient(e)
    return False
