"""The round protocol between a GRPO flow and a resident trainer (``mode: resident``), on shared storage.

For round ``r`` (0, 1, ... ``rounds`` - 1), in ``<rounds_dir>/<r:04d>/`` (the GRPO flow's round folder):

1. The flow writes ``rollouts.jsonl`` (the round's rollouts, ``posttrain.rollouts.format``) atomically:
   whole or absent, never torn (``merge_rollouts``, ``write_rollouts``).
2. Then it writes ``ready.json`` atomically (:func:`hand_round`): a :class:`RoundReady` with the
   rollouts file's name and SHA-256 and the policy version(s) that sampled them. The marker is the
   hand-over: the trainer reads nothing of the round before it exists, and refuses rollouts whose
   SHA-256 is not the marker's (a file replaced after the hand-over).
3. The trainer, holding policy version ``v0 + r`` (``v0``: the initial policy's, 0 for a base model),
   trains on the rollouts (dropping those more than ``max_staleness`` versions older than ``v0 + r``,
   as ``mode: step`` does) and writes ``<output_dir>/checkpoint-<global_step>/`` atomically, the same
   folder a step-mode job of that round writes: with ``num_iterations`` 1, checkpoint N is policy
   version N. The flow follows these with the existing checkpoint watch.

A round is trained once: a restarted trainer resumes from the newest complete checkpoint of
``output_dir`` and waits for the round after it. A handed round is never changed: the flow hands
round ``r`` again only with the same rollouts (same SHA-256). No torch here: the flow imports it.

While the flow works on the rounds (publishing, hot-loading, sampling: minutes each on a real
model) it rewrites ``<rounds_dir>/flow-heartbeat.json`` every few seconds (:func:`beat`; the
thread is ``posttrain.runs.resident.keep_rounds_alive``). The trainer's wait for a round ends
``round_timeout_s`` after the heartbeat last changed (:class:`HeartbeatWatch`), that is once the
flow is gone, not while a slow round is in progress. It compares the file's content with what it
saw before, on its own clock: no clock of the flow's machine or the file server is trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from posttrain.fsutil import atomic_write

ROLLOUTS_FILE = "rollouts.jsonl"
READY_FILE = "ready.json"
#: Rewritten by the flow while it works on the rounds (in ``rounds_dir``, beside the round folders).
HEARTBEAT_FILE = "flow-heartbeat.json"


class RoundError(RuntimeError):
    """A round's hand-over is missing, late or inconsistent; the message names the round and the path."""


class RoundReady(BaseModel):
    """``ready.json``: the flow's word that a round's rollouts are complete."""

    model_config = ConfigDict(extra="forbid")

    round: int = Field(ge=0, description="The round, as in the folder's name.")
    rollouts: str = Field(ROLLOUTS_FILE, description="The rollouts file, relative to the round's folder.")
    rollouts_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the rollouts file.")
    policy_versions: list[int] = Field(
        min_length=1, description="Policy versions that sampled the rollouts, ascending (one for synchronous rounds)."
    )
    created: datetime = Field(description="When the flow handed the round (UTC).")


def start_position(model_dir: str | Path) -> tuple[int, int]:
    """(global_step, policy_version) of the initial policy: from its trainer_state.json, else (0, 0)
    (``posttrain.trainer.step.policy_position``'s rule, without torch): round r's checkpoint is
    ``checkpoint-<global_step + (r + 1) * num_iterations>``."""
    path = Path(model_dir) / "trainer_state.json"
    if not path.exists():
        return 0, 0
    state = json.loads(path.read_text())
    step = int(state.get("global_step", 0))
    return step, int(state.get("policy_version", step))


def round_dir(rounds_dir: str | Path, round: int) -> Path:
    return Path(rounds_dir) / f"{round:04d}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hand_round(rounds_dir: str | Path, round: int, policy_versions: list[int] | int) -> RoundReady:
    """The flow's side: mark ``<rounds_dir>/<round:04d>/rollouts.jsonl`` (already written, atomically)
    as the round's rollouts. Handing a round again with the same file is a no-op (a retried task);
    with another file it is a RoundError (the trainer may have trained on the first)."""
    folder = round_dir(rounds_dir, round)
    sha = file_sha256(folder / ROLLOUTS_FILE)
    versions = sorted({policy_versions} if isinstance(policy_versions, int) else set(policy_versions))
    earlier = read_ready(rounds_dir, round)
    if earlier is not None:
        if earlier.rollouts_sha256 != sha:
            raise RoundError(f"round {round}: {folder / READY_FILE} already hands rollouts "
                             f"{earlier.rollouts_sha256[:12]}, not {sha[:12]}")
        return earlier
    ready = RoundReady(round=round, rollouts_sha256=sha, policy_versions=versions, created=datetime.now(UTC))
    atomic_write(folder / READY_FILE, ready.model_dump_json(indent=2) + "\n")
    return ready


def read_ready(rounds_dir: str | Path, round: int) -> RoundReady | None:
    """The round's marker, or None while the flow has not handed it."""
    path = round_dir(rounds_dir, round) / READY_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        ready = RoundReady.model_validate_json(data)
    except ValueError as e:
        raise RoundError(f"round {round}: {path} is not a round marker ({e})") from None
    if ready.round != round:
        raise RoundError(f"round {round}: {path} hands round {ready.round}")
    return ready


def handed_rollouts(rounds_dir: str | Path, ready: RoundReady) -> Path:
    """The rollouts file a marker hands (its SHA-256 is checked where it is read)."""
    return round_dir(rounds_dir, ready.round) / ready.rollouts


def heartbeat_path(rounds_dir: str | Path) -> Path:
    return Path(rounds_dir) / HEARTBEAT_FILE


def beat(rounds_dir: str | Path, count: int) -> None:
    """The flow's side: rewrite the heartbeat (atomically), its content new each time (``count``)."""
    body = {"beat": count, "at": datetime.now(UTC).isoformat(), "host": socket.gethostname(), "pid": os.getpid()}
    atomic_write(heartbeat_path(rounds_dir), json.dumps(body) + "\n")


class HeartbeatWatch:
    """The trainer's side: seconds since the flow's heartbeat last changed, as this process saw it
    (its monotonic clock; counted from the watch's start until a change is seen)."""

    def __init__(self, rounds_dir: str | Path) -> None:
        self.path = heartbeat_path(rounds_dir)
        self._seen = self._read()
        self._since = time.monotonic()
        self._changed = False

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:  # read across the flow's rename over it (ESTALE on NFS): no change seen this time
            return getattr(self, "_seen", None)

    def age(self) -> float:
        """Look at the heartbeat now; seconds since it last changed (or since the watch started)."""
        now, current = time.monotonic(), self._read()
        if current != self._seen:
            self._seen, self._since, self._changed = current, now, True
        return now - self._since

    def describe(self) -> str:
        """The heartbeat's state in words, for an error."""
        age = time.monotonic() - self._since
        if self._changed:
            return f"the flow's heartbeat {self.path} last changed {age:.1f} s ago"
        if self._seen is None:
            return f"no flow heartbeat at {self.path} in {age:.1f} s"
        return f"the flow's heartbeat {self.path} did not change in {age:.1f} s"
