"""Riding out an outage of an object store: after botocore's own attempts, retry a request that
failed transiently (refused, reset, timed out, 5xx) with back-off until a time budget is spent.

botocore's attempts (8, in a few seconds when connections are refused) cover a blip, not a store
that restarts. ``retry_outage`` repeats the whole call with pauses of 1 s doubling to 30 s for up
to ``budget`` seconds; a request that may have reached the store and is not safe to send again
(a conditional write) is repeated only when it surely did not (refused, 503).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

FIRST_DELAY = 1.0
MAX_DELAY = 30.0
RETRYABLE_CODES = {"SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestTimeout",
                   "InternalError"}
T = TypeVar("T")


def outage_delays(budget: float) -> list[float]:
    """The pauses between repeats of a call within ``budget`` seconds (their sum reaches it)."""
    delays: list[float] = []
    delay = FIRST_DELAY
    while sum(delays) < budget:
        delays.append(min(delay, budget - sum(delays)))
        delay = min(delay * 2, MAX_DELAY)
    return delays


def transient(exc: BaseException, *, resend_safe: bool = True) -> bool:
    """Whether ``exc`` (or what it wraps) says the store is unavailable rather than refusing the call."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, (EndpointConnectionError, ConnectTimeoutError)):
            return True  # never sent
        if isinstance(cause, ClientError):
            status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(cause.response.get("Error", {}).get("Code", ""))
            if status == 503 or code == "SlowDown":
                return True  # refused before doing anything
            return resend_safe and (code in RETRYABLE_CODES or (isinstance(status, int) and status >= 500))
        if resend_safe and isinstance(cause, (ConnectionClosedError, ReadTimeoutError, ResponseStreamingError,
                                              IncompleteReadError)):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def retry_outage(call: Callable[[], T], *, budget: float, what: str, resend_safe: bool = True,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> T:
    """``call()``, repeated through transient failures for up to ``budget`` seconds from the first."""
    deadline: float | None = None
    delay = FIRST_DELAY
    while True:
        try:
            return call()
        except Exception as e:
            if budget <= 0 or not transient(e, resend_safe=resend_safe):
                raise
            now = clock()
            deadline = now + budget if deadline is None else deadline
            if now >= deadline:
                raise
            wait = min(delay, deadline - now)
            log.warning("%s: the store is unavailable (%s); retrying in %.0fs (for %.0fs more at most)", what,
                        type(e).__name__, wait, deadline - now)
            sleep(wait)
            delay = min(delay * 2, MAX_DELAY)
