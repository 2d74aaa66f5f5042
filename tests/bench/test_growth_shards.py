"""bench/growth.py shards at its smallest sizes: what does not depend on the machine's speed.

A GRPO round of 2 and of 4 shards against a Prefect server on PostgreSQL of the test's own (free
ports, a temporary folder; stopped at the end), without the floor and with a train-step that
returns its input checkpoint at once (the round's task runs are the same). A round makes one
task run per shard plus a fixed three, and what it asks of the server (API calls, events, DB rows)
grows at most as the shards do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import growth_shards  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.slow]  # starts servers of its own


def per_shard(row: dict, key: str) -> float:
    return row[key] / row["shards"]


@pytest.mark.timeout(900)  # PostgreSQL, Prefect and the tiny model on a loaded machine
def test_a_round_makes_a_task_run_per_shard_and_asks_the_server_at_most_linearly_more() -> None:
    with growth_shards.prefect_on_postgres() as services:
        small, large = growth_shards.measure_shards([2, 4], 1, services, floor=False, fake_train=True,
                                                    num_generations=2, max_completion_length=4)
    for row in (small, large):
        assert row["task runs/round"] == row["shards"] + growth_shards.FIXED_TASK_RUNS, row
        assert row["events/round"] >= 3 * row["task runs/round"], row  # Pending, Running, Completed at least
    # a fixed part plus a part per shard: per shard, 4 shards ask no more than 2 do (+ 10% for the
    # DB rows, whose counts PostgreSQL publishes late)
    assert per_shard(large, "api calls/round") <= per_shard(small, "api calls/round"), (small, large)
    assert per_shard(large, "events/round") <= per_shard(small, "events/round"), (small, large)
    assert per_shard(large, "db rows/flow") <= 1.1 * per_shard(small, "db rows/flow"), (small, large)
