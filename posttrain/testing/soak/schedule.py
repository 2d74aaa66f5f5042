"""The soak's plan, a pure function of (seed, minutes): the faults, the operator's actions, the nights.

Replayable: the same seed and minutes give the same plan (``random.Random`` with string seeds is
stable across runs and Python versions). Each fault kind appears at least once, however short the
soak; a long soak has about 0.85 faults a minute (51 in an hour: the issue's 50). Durations scale
with the soak so that a 3-minute soak still ends: a store outage lasts 10-120 s from 30 minutes up,
10-21 s in 3 minutes.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

from posttrain.testing.soak import KINDS, OUTAGE_MODES, ROLES

FAULTS_PER_MINUTE = 0.85
WINDOW = (0.08, 0.8)  # faults land in this part of the soak: the start sets up, the end drains
# kind -> (shortest, longest) duration in seconds at full scale (a soak of FULL_SCALE_MIN minutes or more)
DURATIONS = {"worker_kill": (1.0, 30.0), "trainer_kill": (0.0, 0.0), "store_outage": (10.0, 120.0),
             "serve_kill": (1.0, 10.0), "prefect_restart": (2.0, 30.0), "postgres_restart": (2.0, 30.0),
             "spool_full": (5.0, 60.0)}
FULL_SCALE_MIN = 30.0
OPERATOR_ACTIONS = ("rollback", "promote")


@dataclass(frozen=True)
class PlannedFault:
    at_s: float
    kind: str
    target: str
    duration_s: float

    def line(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class PlannedAction:
    at_s: float
    action: str  # rollback | promote


@dataclass(frozen=True)
class Plan:
    seed: int
    minutes: float
    night_s: float
    faults: list[PlannedFault]
    operator: list[PlannedAction]

    @property
    def nights(self) -> int:
        return nights(self.minutes, self.night_s)

    def describe(self) -> str:
        """The plan as a person reads it (printed at the start, and by --dry-run)."""
        lines = [f"soak seed {self.seed}: {self.minutes:g} min, {self.nights} nights of {self.night_s:g} s, "
                 f"{len(self.faults)} faults, {len(self.operator)} operator actions"]
        lines += [f"  fault  at {f.at_s:7.1f} s  {f.kind:<16} {f.target:<14} for {f.duration_s:5.1f} s"
                  for f in self.faults]
        lines += [f"  action at {a.at_s:7.1f} s  {a.action}" for a in self.operator]
        return "\n".join(lines)


def nights(minutes: float, night_s: float) -> int:
    return max(1, int(minutes * 60 // night_s))


def _target(kind: str, rng: random.Random) -> str:
    if kind == "trainer_kill":
        return rng.choice(("nightly", "grpo"))
    if kind == "store_outage":
        return rng.choice(OUTAGE_MODES)
    if kind == "serve_kill":
        return rng.choice(ROLES)
    return {"worker_kill": "worker", "prefect_restart": "prefect-server", "postgres_restart": "postgresql",
            "spool_full": "shared"}[kind]


def plan_faults(seed: int, minutes: float) -> list[PlannedFault]:
    """Every kind once in a seeded order, then seeded draws, spread over the window in even slots
    (each at a seeded point of the first half of its slot)."""
    if minutes <= 0:
        raise ValueError(f"minutes must be positive, not {minutes}")
    rng = random.Random(f"soak-faults-{seed}")
    count = max(len(KINDS), round(minutes * FAULTS_PER_MINUTE))
    kinds = list(KINDS)
    rng.shuffle(kinds)
    kinds += [rng.choice(KINDS) for _ in range(count - len(KINDS))]
    total = minutes * 60
    start, slot = WINDOW[0] * total, (WINDOW[1] - WINDOW[0]) * total / count
    scale = min(1.0, minutes / FULL_SCALE_MIN)
    faults = []
    for i, kind in enumerate(kinds):
        low, high = DURATIONS[kind]
        duration = round(rng.uniform(low, low + (high - low) * scale), 1)
        at = round(start + i * slot + rng.uniform(0, slot / 2), 1)
        faults.append(PlannedFault(at, kind, _target(kind, rng), duration))
    return faults


def plan_operator(seed: int, minutes: float) -> list[PlannedAction]:
    """Rollbacks and promotions at seeded times: one every four minutes or so, at least one of each."""
    rng = random.Random(f"soak-operator-{seed}")
    count = max(2, round(minutes / 4))
    actions = list(OPERATOR_ACTIONS) + [rng.choice(OPERATOR_ACTIONS) for _ in range(count - 2)]
    rng.shuffle(actions)
    total = minutes * 60
    times = sorted(round(rng.uniform(0.3 * total, 0.9 * total), 1) for _ in actions)
    return [PlannedAction(t, a) for t, a in zip(times, actions, strict=True)]


def plan(seed: int, minutes: float, night_s: float) -> Plan:
    return Plan(seed, minutes, night_s, plan_faults(seed, minutes), plan_operator(seed, minutes))
