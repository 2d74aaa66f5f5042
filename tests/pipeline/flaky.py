"""Reward functions for the flow tests, named by import path in ``RolloutSettings.reward_funcs``.

``flaky_reward`` fails once with a transient error, whichever shard calls it first; ``slow_reward``
makes every shard last long enough that concurrent shards visibly overlap.
"""

from __future__ import annotations

import os
import time

FLAKY_MARKER_ENV = "POSTTRAIN_TEST_FLAKY_MARKER"  # a file: the first call creates it and fails
SLOW_SECONDS_ENV = "POSTTRAIN_TEST_SLOW_REWARD_S"


def flaky_reward(completions: list, **kwargs) -> list[float]:
    """Raises ConnectionError on the first call (the one that creates the marker file), then 0.0."""
    marker = os.environ.get(FLAKY_MARKER_ENV)
    if marker:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)
            raise ConnectionError("injected transient failure (flaky_reward, once)")
    return [0.0] * len(completions)


def slow_reward(completions: list, **kwargs) -> list[float]:
    """Sleeps, then scores 0.0: a shard's body lasts at least this long per prompt."""
    time.sleep(float(os.environ.get(SLOW_SECONDS_ENV, "1.0")))
    return [0.0] * len(completions)


FAIL_ROUND_MARKER_ENV = "POSTTRAIN_TEST_FAIL_ROUND"  # "<round>:<file>": fail that round while the file exists


def round_failing_reward(completions: list, **kwargs) -> list[float]:
    """Raises ValueError (not transient: no shard retry helps) in the rollout shards of one round while
    a marker file exists (``POSTTRAIN_TEST_FAIL_ROUND=<round>:<file>``); scores by length otherwise."""
    spec = os.environ.get(FAIL_ROUND_MARKER_ENV)
    if spec:
        from prefect.runtime import task_run

        round, marker = spec.split(":", 1)  # the shard's task run is named round-<r>-shard-<s>
        if os.path.exists(marker) and str(task_run.name or "").startswith(f"round-{round}-"):
            raise ValueError(f"injected: round {round}'s reward fails while {marker} exists")
    return [float(len(c if isinstance(c, str) else str(c))) for c in completions]
