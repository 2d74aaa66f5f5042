"""Which failures a task retries: transient ones only (network, timeouts, throttling)."""

from __future__ import annotations

TRANSIENT_NAMES = {
    "ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "TimeoutError", "EndpointConnectionError",
    "ConnectionClosedError", "HotLoadTimeout", "_Transient", "CompletionsUnavailable",
}


def is_transient(exc: BaseException) -> bool:
    from posttrain.inference.contract import HotLoadAPIError

    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, HotLoadAPIError) and getattr(exc, "status", None) in (429, 500, 502, 503, 504):
        return True
    return any(t.__name__ in TRANSIENT_NAMES for t in type(exc).__mro__)


def transient_only(task, task_run, state) -> bool:
    """``retry_condition_fn`` for Prefect tasks."""
    try:
        state.result()
    except Exception as e:  # noqa: BLE001 - classifying, not handling
        return is_transient(e)
    return False
