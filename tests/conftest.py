"""Fixtures shared by every test folder live in ``tests/support`` (registered here).

Tests that need a service (Slurm, SeaweedFS, a Prefect server, Prometheus) are marked ``services``:
``pytest -m "not services"`` is the fast subset that starts nothing.

Under pytest-xdist (the test command runs ``-n 3 --dist loadgroup``) tests that share something are
a group, run one after another in one worker:
- orchestration: the tests of the suite's Prefect server (``prefect_api``: its process worker, the
  default blocks that point at this session's reference server), first;
- slurm: the other tests that run jobs on the Slurm cluster (its fixtures, or the ``slurm`` mark),
  beside it. The cluster's two nodes have room for a job of each group at once (a CPU each per
  node); within a group, tests that assert how fast a cancel or requeue acts never share the nodes;
Every other module is a group of its own (its module fixtures start once), run by whichever worker
is free: orchestration and slurm are handed out first, then the short soak, then the modules with
``slow`` tests, then the rest (the test command keeps this order: ``--no-loadscope-reorder``; xdist would order the groups by
their number of tests, and the longest could start last). A module marked ``prefect_own_blocks`` uses
the suite's Prefect server with blocks of its own only, beside the orchestration group.
"""

from __future__ import annotations

import os

import pytest

# One OpenMP/MKL thread for torch in every test process and in what they start (trainers, flow runs, the
# Prefect worker, Slurm jobs submitted from here, vLLM): the suite runs three xdist workers on two cores, and
# a tiny model's ops split over two threads that share a core with the other worker spin at every
# barrier. Two sessions of the trainer tests side by side took 63 s with torch's default (a thread per
# core), 32 s with one. Set before anything imports torch; a value the caller exported wins.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# vLLM's CPU build pins its worker to core 0 ("auto"): two engines at once (one per xdist worker, or a
# test's beside a module's) shared that core, and a start passed 300 s. Unpinned, the OS spreads them.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

pytest_plugins = [
    "tests.support.cluster",
    "tests.support.prometheus",
    "tests.support.real_model",
    "tests.support.s3",
    "tests.support.serving",
    "tests.support.tensors",
    "tests.support.training",
]

# Fixtures that reach a service the test command starts (or that start one themselves); the real model
# counts as one: the test command prepares it, and a first use elsewhere downloads it.
SERVICE_FIXTURES = {"slurm_cluster", "slurm_cluster_2nodes", "seaweedfs_endpoint", "seaweedfs_bucket", "prefect_api",
                    "prometheus", "real_model_dir"}
# The suite's Prefect server: its tests run one after another in one xdist worker.
ORCHESTRATION_FIXTURES = {"prefect_api"}
ORCHESTRATION = "orchestration"
# The Slurm cluster: the tests that use it without the Prefect server, one after another.
SLURM_FIXTURES = {"slurm_cluster", "slurm_cluster_2nodes"}
SLURM = "slurm"
SOAK = "tests/soak/test_short_soak.py"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: runs jobs on the Slurm cluster without asking for its fixture at "
                                       "collection (the Slurm group of tests/conftest.py)")
    config.addinivalue_line("markers", "prefect_own_blocks: uses the suite's Prefect server with blocks of its own "
                                       "only (not the default blocks, the deployments or the worker): it may run "
                                       "beside the orchestration group (tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker adds each group to the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())) or "seaweedfs" in params.values():
            item.add_marker(pytest.mark.services)
    # In a worker xdist sets dist to "no" and loadgroup to True.
    if config.getoption("loadgroup", False) or config.getoption("dist", "no") == "loadgroup":
        _group_for_workers(items)


def _group_for_workers(items: list[pytest.Item]) -> None:
    """The groups of the module docstring: orchestration first (the longest starts at once), then
    slurm beside it, then the modules with slow tests, then every other module."""
    def group(item: pytest.Item) -> str:
        fixtures = set(getattr(item, "fixturenames", ()))
        if ORCHESTRATION_FIXTURES & fixtures and not item.get_closest_marker("prefect_own_blocks"):
            return ORCHESTRATION
        if SLURM_FIXTURES & fixtures or item.get_closest_marker("slurm"):
            return SLURM
        return item.nodeid.split("::", 1)[0]

    groups = {id(item): group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    slow = {groups[id(i)] for i in items if i.get_closest_marker("slow")}
    # the short soak (7 min, alone in its module) right after slurm: the longest of the rest starts early
    first = {ORCHESTRATION: 0, SLURM: 1, SOAK: 1.5}
    # stable: collection order within each part
    items.sort(key=lambda i: first.get(groups[id(i)], 2 if groups[id(i)] in slow else 3))


# Time per group (setup, call and teardown of its tests): the suite's wall time is its longest worker's,
# and a worker runs whole groups, so the groups' times show where the budget goes. Printed after the
# slowest tests (--durations) in the test command's report.
_group_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    group = report.nodeid.rsplit("@", 1)[1] if "@" in report.nodeid else report.nodeid.split("::", 1)[0]
    _group_seconds[group] = _group_seconds.get(group, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _group_seconds or not config.getoption("durations", None):
        return
    top = sorted(_group_seconds.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_sep("=", f"slowest groups (of {len(_group_seconds)}; {sum(_group_seconds.values()):.0f} s "
                                    "in all)")
    for group, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f}s {group}")
