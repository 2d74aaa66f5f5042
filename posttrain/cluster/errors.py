"""Errors of the cluster backends. Every message names the setting or the job at fault."""

from __future__ import annotations


class ClusterError(Exception):
    """Base class of the errors raised by ``posttrain.cluster``."""


class ConfigError(ClusterError, ValueError):
    """A setting is invalid; ``field`` is its dotted name as users write it (``job.output_dir``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class SubmissionError(ClusterError):
    """The scheduler or API server refused the job, or could not be reached."""


class JobFailed(ClusterError):
    """The job ended in a state other than completed; the message carries the reason."""

    def __init__(self, job_id: str, state: str, reason: str) -> None:
        super().__init__(f"job {job_id} ended {state}: {reason}")
        self.job_id = job_id
        self.state = state
        self.reason = reason


def describe_validation_error(error: Exception, prefix: str = "") -> str:
    """One line per problem of a pydantic ``ValidationError``, each starting with the dotted
    field name (``cluster.env``); other exceptions are returned as their message."""
    errors = getattr(error, "errors", None)
    if errors is None:
        return str(error)
    lines = []
    for item in errors():
        loc = ".".join(str(p) for p in item.get("loc", ()))
        where = ".".join(p for p in (prefix, loc) if p)
        message = item.get("msg", "")
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        lines.append(f"{where}: {message}" if where else message)
    return "\n".join(lines)
