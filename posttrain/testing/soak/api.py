"""The few calls the soak makes to the Prefect API, over its REST interface (the soak is test code:
Prefect's client stays in ``posttrain.pipeline``): a deployment run, and a flow run's state."""

from __future__ import annotations

import json
import os
import urllib.request
from urllib.parse import quote


def _call(method: str, path: str, body: dict | None = None, timeout: float = 30) -> dict:
    api = os.environ["PREFECT_API_URL"].rstrip("/")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{api}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def create_run(deployment: str, parameters: dict, idempotency_key: str) -> dict:
    """A flow run of ``deployment`` (``<flow>/<deployment>``), Scheduled now; the same key twice gives
    the same run (a call retried after its answer was lost starts nothing more)."""
    flow, name = deployment.split("/", 1)
    found = _call("GET", f"/deployments/name/{quote(flow)}/{quote(name)}")
    return _call("POST", f"/deployments/{found['id']}/create_flow_run",
                 {"parameters": parameters, "idempotency_key": idempotency_key})


def run_state(flow_run_id: str) -> tuple[str | None, str, str]:
    """(state type, state name, message) of a flow run."""
    state = _call("GET", f"/flow_runs/{flow_run_id}").get("state") or {}
    return state.get("type"), state.get("name") or "", state.get("message") or ""
