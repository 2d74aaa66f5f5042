"""The soak folder's files (the contract in ``posttrain.testing.soak``): each ``.jsonl`` appended one
line at a time and flushed at once, from any thread."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class Recorder:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files = {}
        for name in ("schedule", "faults", "runs", "operator", "replies"):
            self._files[name] = open(folder / f"{name}.jsonl", "a", buffering=1)  # noqa: SIM115 - kept open
        self._log = open(self.logs / "driver.log", "a", buffering=1)  # noqa: SIM115

    def write(self, name: str, row: dict) -> None:
        line = json.dumps(row, default=str)
        with self._lock:
            self._files[name].write(line + "\n")

    def log(self, message: str) -> None:
        line = f"{now()} {message}"
        with self._lock:
            self._log.write(line + "\n")
        print(line, file=sys.stderr, flush=True)

    def write_json(self, name: str, data: dict) -> None:
        path = self.folder / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(path)

    def close(self) -> None:
        with self._lock:
            for f in (*self._files.values(), self._log):
                f.close()


class Background:
    """A soak actor on a thread of its own (client, nights, operator, faults): ``start``, ``stop`` (sets
    ``stopping`` and joins); subclasses write ``_loop`` and wait with ``_until``."""

    def __init__(self, name: str, t0: float = 0.0) -> None:
        self.t0 = t0
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join()

    def _until(self, at_s: float) -> bool:
        """Wait until ``at_s`` seconds after ``t0``; True when the soak is stopping instead."""
        return self.stopping.wait(max(0.0, self.t0 + at_s - time.monotonic()))

    def _loop(self) -> None:
        raise NotImplementedError
