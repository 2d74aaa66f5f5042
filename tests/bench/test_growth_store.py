"""bench/growth.py store at small sizes: what the store-wide commands read, not how fast.

Two folder stores, 10 and 40 snapshots (2 and 8 runs), with the same promotion histories (4
records for each of 3 deployments, on the same steps of their runs, so every rollback target has
the same chain length). What a rollback or a promotion's champion lookup reads must not grow with
the snapshots of other runs; ``history`` reads its deployment's records only; ``gc --dry-run`` and
``chain inspect``, which must read the whole store, read a bounded amount per snapshot.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import growth_store  # noqa: E402

SMALL, LARGE = 10, 40


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], dict]:
    measured = growth_store.measure_store((SMALL, LARGE), tmp_path_factory.mktemp("growth-store"),
                                          steps_per_run=5, records=4)
    return {(r["snapshots"], r["operation"]): r for r in measured}


def test_every_operation_is_measured_at_both_sizes(rows: dict[tuple[int, str], dict]) -> None:
    assert set(rows) == {(n, op) for n in (SMALL, LARGE) for op in growth_store.OPERATIONS}
    assert rows[LARGE, "history"]["runs"] == 8 and rows[SMALL, "history"]["runs"] == 2
    for row in rows.values():
        assert row["reads"] > 0 and row["must"] > 0


@pytest.mark.parametrize("operation", ["champion lookup", "rollback", "history"])
def test_what_one_deployment_needs_is_read_the_same_whatever_else_the_store_holds(
        rows: dict[tuple[int, str], dict], operation: str) -> None:
    small, large = rows[SMALL, operation], rows[LARGE, operation]
    assert large["must"] == small["must"]  # the same history, a target chain of the same length
    assert large["reads"] == small["reads"], (small, large)
    assert large["lists"] == small["lists"], (small, large)
    # the snapshots' bytes differ by a few bytes of compressed deltas, not by the store's size
    assert large["bytes_read"] <= 1.05 * small["bytes_read"], (small, large)


def test_history_lists_only_its_own_records(rows: dict[tuple[int, str], dict]) -> None:
    for n in (SMALL, LARGE):
        row = rows[n, "history"]
        assert row["keys_listed"] == row["reads"] == row["must"] == 4


@pytest.mark.parametrize("operation", ["gc --dry-run", "chain inspect"])
def test_whole_store_commands_read_a_bounded_amount_per_snapshot(
        rows: dict[tuple[int, str], dict], operation: str) -> None:
    small, large = rows[SMALL, operation], rows[LARGE, operation]
    assert large["must"] > small["must"]
    per_item = [growth_store.gc_common.ratio(r["touched"], r["must"]) for r in (small, large)]
    assert per_item[1] <= 1.25 * per_item[0], (small, large)


# promotion and rollback wait for gc (live_gc_leases): they list gc's leases only, in a folder of
# their own; they used to list every key under .posttrain/runs/ (every run's ledger and step claims)
@pytest.mark.parametrize("operation", ["champion lookup", "rollback"])
def test_keys_listed_by_a_promotion_or_rollback_do_not_grow_with_other_runs(
        rows: dict[tuple[int, str], dict], operation: str) -> None:
    small, large = rows[SMALL, operation], rows[LARGE, operation]
    assert large["keys_listed"] == small["keys_listed"], (small, large)
