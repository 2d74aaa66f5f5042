"""Fixtures shared by every test folder live in ``tests/support`` (registered here).

Tests that need a service (Slurm, SeaweedFS, a Prefect server, Prometheus) are marked ``services``:
``pytest -m "not services"`` is the fast subset that starts nothing.

Under pytest-xdist (the test command runs ``-n 2 --dist loadgroup``) the tests that drive the
Prefect server's process worker or the Slurm cluster form one group, run first and one after
another in one worker: they share that worker and the cluster's nodes, and some assert how fast
a cancel or requeue acts. Every other module is a group of its own (its module fixtures, a vLLM
server for instance, start once), run by whichever worker is free.
"""

from __future__ import annotations

import pytest

pytest_plugins = [
    "tests.support.cluster",
    "tests.support.prometheus",
    "tests.support.s3",
    "tests.support.serving",
    "tests.support.tensors",
    "tests.support.training",
]

# Fixtures that reach a service the test command starts (or that start one themselves).
SERVICE_FIXTURES = {"slurm_cluster", "slurm_cluster_2nodes", "seaweedfs_endpoint", "seaweedfs_bucket", "prefect_api",
                    "prometheus"}
# Fixtures of the tests that run one after another in one xdist worker.
ORCHESTRATION_FIXTURES = {"slurm_cluster", "slurm_cluster_2nodes", "prefect_api"}
ORCHESTRATION = "orchestration"


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
    """The orchestration tests first (the longest group starts at once), in collection order. (Taking
    the vLLM groups first as well ran them all beside the orchestration group, and the suite took
    longer: both are CPU-bound on two cores.)"""
    orchestration = {id(i) for i in items if ORCHESTRATION_FIXTURES & set(getattr(i, "fixturenames", ()))}
    for item in items:
        group = ORCHESTRATION if id(item) in orchestration else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda i: id(i) not in orchestration)  # stable: collection order within each part

