"""Crash points: named places where a test may SIGKILL the process, to prove a redo is safe.

The publisher calls ``crashpoint("after_encode")`` and the like between its redo-safe steps.
Unless ``POSTTRAIN_CRASH_AT=name[:n]`` is set, a crash point does nothing; with it, the process
kills itself the n-th time it reaches ``name`` (``tests/publish`` kills the publisher at every
point and checks that a second run publishes each step exactly once).
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "POSTTRAIN_CRASH_AT"


def crashpoint(name: str) -> None:
    """Test hook: ``POSTTRAIN_CRASH_AT=name[:n]`` SIGKILLs this process the n-th time ``name`` is hit."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    target, _, count = spec.partition(":")
    if target != name:
        return
    hits = _crash_hits[name] = _crash_hits.get(name, 0) + 1
    if hits >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)


_crash_hits: dict[str, int] = {}
