"""The soak's own Prefect server and PostgreSQL (``bench/soak.py --services own``, the default).

The soak restarts the Prefect server and PostgreSQL (its ``prefect_restart`` and
``postgres_restart`` faults). On the test command's shared ones, every test running beside it would
meet those restarts, so the soak starts a pair of its own, on free ports, with their folders under
the soak's work folder, by the same scripts the suite uses (scripts/services/start-postgres.sh,
start-prefect.sh), with their folders below /tmp/posttrain-soak-services (not below the soak's folder:
as root, PostgreSQL runs as the ``postgres`` user, who must be able to reach its data folder, and a
test's tmp_path is private to root). It points this process's environment at them (PREFECT_API_URL and the
variables those scripts read), so that every process the soak starts, and each restart fault,
uses them. SeaweedFS stays shared: the soak has a bucket of its own, and its store faults go
through its own proxy.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[3] / "scripts" / "services"
BASE = Path("/tmp/posttrain-soak-services")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServices:
    """A PostgreSQL and a Prefect server on it, in a new folder below ``BASE``; ``start`` exports their
    environment, ``stop`` stops them and removes the folder."""

    def __init__(self) -> None:
        BASE.mkdir(parents=True, exist_ok=True)
        BASE.chmod(0o755)
        self.root = Path(tempfile.mkdtemp(prefix="soak-", dir=BASE))
        self.root.chmod(0o755)
        self.prefect_port, self.postgres_port = free_port(), free_port()
        self.env = {
            "PREFECT_PORT": str(self.prefect_port), "PREFECT_API_URL": f"http://127.0.0.1:{self.prefect_port}/api",
            "POSTTRAIN_PREFECT_DIR": str(self.root / "prefect"), "POSTTRAIN_PREFECT_DB": "postgres", "PREFECT_UI": "0",
            "POSTGRES_PORT": str(self.postgres_port), "POSTTRAIN_POSTGRES_DIR": str(self.root / "postgres"),
            "POSTGRES_FSYNC": "off",  # throwaway data
        }

    def _script(self, name: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SERVICES / name)], env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=timeout)

    def start(self, say) -> None:  # noqa: ANN001 - the recorder's log
        for script in ("start-postgres.sh", "start-prefect.sh"):
            done = self._script(script)
            if done.returncode != 0:
                raise RuntimeError(f"{script} for the soak's own services failed (rc {done.returncode}): "
                                   f"{(done.stdout + done.stderr)[-2000:]}")
            say(f"own services: {done.stdout.strip().splitlines()[-1] if done.stdout.strip() else script}")
        os.environ.update(self.env)

    def stop(self, say) -> None:  # noqa: ANN001
        for script in ("stop-prefect.sh", "stop-postgres.sh"):
            done = self._script(script, timeout=120)
            say(f"own services: {script} rc {done.returncode}")
        shutil.rmtree(self.root, ignore_errors=True)
