"""One server of an engine behind the gateway, and what the gateway last read back from it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from posttrain.serve.engine import EngineClient, EngineProcess


@dataclass
class Replica:
    name: str
    client: EngineClient
    process: EngineProcess | None = None  # a server this gateway supervises, or None for one at a URL
    error: str | None = None  # why it takes no request; None when it serves the served version
    restarting: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    label: str | None = None  # the weight version it reports while it holds the served version (SGLang)
    expected: list[float] | None = None  # its fingerprint, measured when it last took the served version
    readback: dict[str, int | None] | None = None  # parameters compared by digest (``readback``), and rows
    held_identity: str | None = None  # the last reload it reported verifying itself (None after a restart)
    held_checked: bool = False  # its digests were read back equal to a folder's at least once
    answered: int = 0  # requests it answered since the monitor last read back what it holds
    read_at: float = 0.0  # when (time.monotonic) the monitor last read back what it holds
