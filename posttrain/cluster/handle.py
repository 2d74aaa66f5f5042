"""Behaviour shared by the job handles: waiting, cancel on abort, the dry-run handle."""

from __future__ import annotations

import time
from typing import Any

from posttrain.cluster.errors import JobFailed
from posttrain.cluster.spec import JobState


class HandleBase:
    """Subclasses provide ``job_id``, ``log_path``, ``state``, ``done``, ``tail_log``, ``cancel``,
    ``failure_reason`` and ``_result``."""

    job_id: str
    log_path: str
    poll_s: float = 2.0

    def state(self) -> JobState:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def failure_reason(self) -> str | None:
        raise NotImplementedError

    def _result(self) -> Any:
        return None

    def wait(self, timeout_s: float | None = None) -> JobState:
        """Block until the job ends; returns its final state. ``TimeoutError`` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {self.state().value} after {timeout_s:.0f} s")
            time.sleep(self.poll_s)
        return self.state()

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait, then return the job's result (the callable's return value; None for commands).
        Raises ``JobFailed`` with the reason when the job did not complete."""
        state = self.wait(timeout_s)
        if state != JobState.COMPLETED:
            raise JobFailed(self.job_id, state.value, self.failure_reason() or "no reason reported")
        return self._result()

    def __enter__(self) -> HandleBase:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and not self.done():
            self.cancel()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(job_id={self.job_id!r}, log_path={self.log_path!r})"


class DryRunHandle(HandleBase):
    """Returned by ``submit`` when ``dry_run`` is set: nothing was submitted."""

    def __init__(self, rendered: str) -> None:
        self.job_id = "dry-run"
        self.log_path = ""
        self.rendered = rendered

    def state(self) -> JobState:
        return JobState.DRY_RUN

    def done(self) -> bool:
        return True

    def tail_log(self, n: int = 40, rank: int | None = None) -> str:
        return ""

    def cancel(self) -> None:
        pass

    def failure_reason(self) -> str | None:
        return None

    def result(self, timeout_s: float | None = None) -> Any:
        return None


def log_excerpt(text: str, n: int = 15) -> str:
    """The last ``n`` lines a job printed before submitit logged its traceback: that is where a
    failing command says why; the traceback itself only says the command failed."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            lines = lines[:i]
            break
    while lines and lines[-1].startswith("submitit "):
        lines.pop()  # submitit's own messages around the failure
    return "\n".join(lines[-n:]) + "\n"
