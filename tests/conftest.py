"""Fixtures shared by every test folder live in ``tests/support`` (registered here).

Tests that need a service (Slurm, SeaweedFS, a Prefect server) are marked ``services``:
``pytest -m "not services"`` is the fast subset that starts nothing.
"""

from __future__ import annotations

import pytest

pytest_plugins = [
    "tests.support.cluster",
    "tests.support.s3",
    "tests.support.serving",
    "tests.support.tensors",
    "tests.support.training",
]

# Fixtures that reach a service the test command starts (or that start one themselves).
SERVICE_FIXTURES = {"slurm_cluster", "slurm_cluster_2nodes", "seaweedfs_endpoint", "seaweedfs_bucket", "prefect_api"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())) or "seaweedfs" in params.values():
            item.add_marker(pytest.mark.services)
