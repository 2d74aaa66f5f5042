"""scripts/services/start-prefect.sh on a port other than 4200: the UI is told that port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.s3 import free_port

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "services"


@pytest.mark.services
def test_ui_settings_name_the_servers_port(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_PORT": str(port),
        "POSTTRAIN_SERVICES_DIR": str(tmp_path),
        "POSTTRAIN_PREFECT_DIR": str(tmp_path / "prefect"),
        "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent),
        "POSTTRAIN_PREFECT_DB": "sqlite",  # not the suite's PostgreSQL database (scripts/test.sh)
    }
    env.pop("PREFECT_API_URL", None)
    try:
        subprocess.run(["bash", str(SCRIPTS / "start-prefect.sh")], env=env, check=True, timeout=120,
                       capture_output=True, text=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10) as r:
            settings = json.load(r)
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop-prefect.sh")], env=env, timeout=60, capture_output=True)
    assert settings["api_url"] == f"http://127.0.0.1:{port}/api"
