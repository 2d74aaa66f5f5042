"""The soak checker's shared pieces: the soak folder as the driver wrote it, a check's result, and
the refusal of NaN in every numeric comparison (``finite``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

SOAK_FILES = ("schedule", "faults", "runs", "operator", "replies")


def finite(*values: object) -> bool:
    """Whether every value is a real, finite number (NaN, inf, None, bools and strings are not)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def parse_time(text: object) -> float | None:
    """Seconds since the epoch of an ISO time (UTC when it names no zone); None when unreadable."""
    if isinstance(text, (int, float)) and finite(text):
        return float(text)
    if not isinstance(text, str):
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


@dataclass
class CheckResult:
    name: str
    items: int = 0
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def bad(self, what: str) -> None:
        self.violations.append(what)


@dataclass
class Soak:
    """A soak folder as the driver left it."""

    dir: Path
    meta: dict
    records: dict[str, list[dict]]
    problems: list[str]  # what could not be read

    @classmethod
    def read(cls, folder: str | Path) -> Soak:
        folder = Path(folder)
        problems: list[str] = []
        try:
            meta = json.loads((folder / "soak.json").read_text())
        except (OSError, ValueError) as e:
            meta = {}
            problems.append(f"{folder}/soak.json cannot be read ({e})")
        records: dict[str, list[dict]] = {}
        for name in SOAK_FILES:
            path = folder / f"{name}.jsonl"
            rows: list[dict] = []
            try:
                lines = path.read_text().splitlines()
            except OSError as e:
                problems.append(f"{path} cannot be read ({e})")
                lines = []
            for n, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    problems.append(f"{path}:{n} is not JSON")
            records[name] = rows
        return cls(folder, meta, records, problems)

    @property
    def store(self) -> dict:
        return self.meta.get("store") or {}

    def window(self) -> tuple[float | None, float | None]:
        return parse_time(self.meta.get("started_at")), parse_time(self.meta.get("ended_at"))

    def run_dirs(self) -> list[Path]:
        return [Path(p) for p in self.meta.get("run_dirs") or []]

    def productions(self) -> dict[str, dict]:
        """Role -> deployment entry, for the production deployments of soak.json."""
        deps = self.meta.get("deployments") or {}
        return {k: v for k, v in deps.items() if isinstance(v, dict)
                and (k.startswith("production") or v.get("role") == "production")}

    def history_of(self, entry: dict, role: str) -> tuple[str, str]:
        """(deployment name, store prefix) of a deployment's history: ``history`` is the name, or
        ``{"deployment"|"deployment_id"|"name": ..., "prefix": ...}``."""
        h = entry.get("history")
        prefix = self.store.get("prefix") or ""
        if isinstance(h, dict):
            name = h.get("deployment") or h.get("deployment_id") or h.get("name") or role
            return str(name), str(h.get("prefix", prefix) or "")
        return (str(h) if h else str(entry.get("deployment_id") or role)), prefix
