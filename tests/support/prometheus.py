"""A real Prometheus (Debian's package, scripts/services/start-prometheus.sh) that tests point at
their servers: ``prometheus.scrape(url, token)`` writes the file_sd targets file (re-read every
second) and the bearer-token file, ``prometheus.query(expr)`` asks its HTTP API.

The test command starts one and exports ``POSTTRAIN_PROMETHEUS_URL`` (and ``POSTTRAIN_PROMETHEUS_DIR``,
where its targets and token files are); without it the fixture starts its own on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from posttrain.fsutil import atomic_write

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "services"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str, folder: Path):
        self.url = url.rstrip("/")
        self.folder = folder

    def scrape(self, url: str, token: str | None = None, **labels: str) -> str:
        """Make ``url`` (its /metrics) Prometheus's only target; returns the target's instance label."""
        instance = urlsplit(url).netloc
        atomic_write(self.folder / "token", (token or "no-token") + "\n")
        atomic_write(self.folder / "targets.json", json.dumps([{"targets": [instance], "labels": labels}]))
        return instance

    def clear(self) -> None:
        atomic_write(self.folder / "targets.json", "[]")

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """The instant vector (or scalar as one sample) of ``expr``, now or ``at`` (a Unix time):
        [{"metric": {...}, "value": float}]."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        r = requests.get(f"{self.url}/api/v1/query", params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", body
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": float(data["result"][1])}]
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def wait_scraped(self, instance: str, after: float, timeout: float = 30) -> None:
        """Wait until Prometheus has scraped ``instance`` successfully at a time later than ``after``."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            targets = requests.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            for t in targets:
                if t["labels"].get("instance") == instance:
                    last = t
                    scraped = _rfc3339_seconds(t.get("lastScrape", ""))
                    if t["health"] == "up" and scraped is not None and scraped > after:
                        return
            time.sleep(0.2)
        raise AssertionError(f"Prometheus did not scrape {instance} after {after} within {timeout} s: {last}")


def _rfc3339_seconds(text: str) -> float | None:
    from datetime import datetime

    if not text or text.startswith("0001-"):
        return None
    head, _, frac = text.rstrip("Z").partition(".")
    zone = ""
    for sign in ("+", "-"):
        if sign in frac:
            frac, _, zone = frac.partition(sign)
            zone = sign + zone
    base = datetime.fromisoformat(head + (zone or "+00:00"))
    return base.timestamp() + (float(f"0.{frac}") if frac else 0.0)


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    given = os.environ.get("POSTTRAIN_PROMETHEUS_URL")
    if given:
        folder = Path(os.environ.get("POSTTRAIN_PROMETHEUS_DIR") or
                      Path(os.environ.get("POSTTRAIN_SERVICES_DIR", "/tmp/posttrain-services")) / "prometheus")
        p = Prometheus(given, folder)
        yield p
        p.clear()
        return
    port = free_port()
    folder = tmp_path_factory.mktemp("prometheus")
    env = {**os.environ, "POSTTRAIN_PROMETHEUS_PORT": str(port), "POSTTRAIN_PROMETHEUS_DIR": str(folder),
           "POSTTRAIN_BIN_DIR": os.environ.get("POSTTRAIN_BIN_DIR", str(Path(sys.executable).parent))}
    started = subprocess.run(["bash", str(SCRIPTS / "start-prometheus.sh")], env=env, capture_output=True,
                             text=True, timeout=600)
    try:
        if started.returncode != 0:
            pytest.fail(f"start-prometheus.sh failed ({started.returncode}):\n{started.stdout}{started.stderr}")
        yield Prometheus(f"http://127.0.0.1:{port}", folder)
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop-prometheus.sh")], env=env, capture_output=True, timeout=60)
