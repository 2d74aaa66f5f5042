"""The schedule and the operator: compressed nights that start a nightly run (promote_to production)
and a GRPO run (max_staleness 1) each, and gc at each night's end; an operator who rolls production
back and promotes what staging serves at the planned times. Everything through the same doors a
site uses: deployment runs on the Prefect API, ``posttrain rollback`` and ``posttrain gc``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

from posttrain.testing.soak.api import create_run, run_state
from posttrain.testing.soak.record import Background, Recorder, now
from posttrain.testing.soak.schedule import PlannedAction
from posttrain.testing.soak.system import REPO, REWARDS, System

MAX_STALENESS = 1
# A resident trainer whose flow stopped beating (a run that failed or is not retried in time) ends this long
# after the last beat; the checker holds it to that (check_leftovers)
ROUND_TIMEOUT_S = 120
GC_KEEP_RUNS = 2
API_RETRY_S = 180.0  # how long a call to the Prefect API is retried (the server may be restarting)
# A Crashed run is retried by the automation at once (docs/recovery.md): it counts as ended only once it has
# stayed Crashed this long (bench/soak.py --crashed-settle-s). Prefect holds a Crashed event whose preceding
# state event it has not seen for up to 15 minutes (PRECEDING_EVENT_LOOKBACK, an in-memory record): after a
# Prefect server restart the retry of a run that was Running before it comes that late.
CRASHED_SETTLE_S = 120.0
TRAINER = {"learning_rate": 1e-3, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4,
           "use_cpu": True, "watch_poll_s": 0.5}
# greedy eval (a temperature under 1e-5 samples greedily); non-inferiority with the widest margin: the
# soak wants promotions to happen (the gate's statistics are tested elsewhere); a first promotion on its own
# eval: the boot weights' comparison would sample production's faulted gateway, which the soak does not count on
GATE = {"eval_samples_per_prompt": 2, "eval_max_tokens": 4, "eval_temperature": 1e-6, "gate_rule": "non-inferiority",
        "gate_margin": 1.0, "gate_first_promotion": "own_eval"}


def nightly_params(system: System) -> dict:
    return {**TRAINER, **GATE, "reward_funcs": REWARDS, "max_steps": 2, "save_steps": 1,
            "promote_to": system.gateways["production"].block, "eval_dataset": str(system.eval_dataset)}


def grpo_params() -> dict:
    return {**TRAINER, "reward_funcs": REWARDS, "rounds": 3, "prompts_per_round": 2, "shards": 1,
            "round_timeout_s": ROUND_TIMEOUT_S, "max_staleness": MAX_STALENESS, "trainer_job": "resident"}


def with_retries(call, what: str, rec: Recorder, budget_s: float = API_RETRY_S):
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - the API may be down (a prefect_restart or postgres_restart)
            if time.monotonic() > deadline:
                raise
            rec.log(f"{what}: {type(e).__name__}: {str(e)[:200]}; retrying")
            time.sleep(3)


class Nights(Background):
    """Night n starts at n x night_s: a nightly and a GRPO run (a kind whose last run has not ended is
    not started again: it is logged), and gc when the night ends."""

    def __init__(self, system: System, rec: Recorder, nights: int, night_s: float, t0: float) -> None:
        super().__init__("nights", t0)
        self.system, self.rec, self.nights, self.night_s = system, rec, nights, night_s
        self.started: dict[str, str] = {}  # flow run id -> kind
        self.skipped = 0

    def _loop(self) -> None:
        for night in range(self.nights):
            if self._until(night * self.night_s):
                return
            self.rec.log(f"night {night} begins")
            for kind in ("nightly", "grpo"):
                self._start_run(kind, night)
            if self._until((night + 1) * self.night_s - 5):
                return
            run_gc(self.system, self.rec)

    def _start_run(self, kind: str, night: int) -> None:
        for flow_run_id, k in self.started.items():
            if k == kind and not is_final(flow_run_id, self.rec):
                self.rec.log(f"night {night}: the {kind} run {flow_run_id} has not ended: no new {kind} run")
                self.skipped += 1
                return
        params = nightly_params(self.system) if kind == "nightly" else grpo_params()
        name = self.system.deployment(kind)
        key = f"{self.system.name}-{self.system.bucket}-{kind}-{night}"
        try:
            run = with_retries(lambda: create_run(name, params, key), f"starting {name}", self.rec)
        except Exception as e:  # noqa: BLE001
            self.rec.log(f"night {night}: {name} could not be started: {type(e).__name__}: {e}")
            return
        self.started[run["id"]] = kind
        self.rec.write("runs", {"flow_run_id": run["id"], "deployment": name, "kind": kind, "night": night,
                                "started_at": now(), "run_name": run.get("name")})
        self.rec.log(f"night {night}: started {name}: flow run {run['id']} ({run.get('name')})")


_crashed_since: dict[str, float] = {}


def is_final(flow_run_id: str, rec: Recorder, crashed_settle_s: float = CRASHED_SETTLE_S) -> bool:
    """Completed, Failed or Cancelled; Crashed only once it has stayed Crashed CRASHED_SETTLE_S (the retry
    automation reschedules a Crashed run within seconds)."""
    try:
        state, _, _ = run_state(flow_run_id)
    except Exception as e:  # noqa: BLE001 - the API may be restarting
        rec.log(f"reading flow run {flow_run_id}: {type(e).__name__}: {str(e)[:200]}")
        return False
    if state == "CRASHED":
        since = _crashed_since.setdefault(flow_run_id, time.monotonic())
        return time.monotonic() - since > crashed_settle_s
    _crashed_since.pop(flow_run_id, None)
    return state in ("COMPLETED", "FAILED", "CANCELLED")


def wait_all_final(flow_run_ids: list[str], rec: Recorder, timeout_s: float,
                   crashed_settle_s: float = CRASHED_SETTLE_S) -> list[str]:
    """Until every run is final (``is_final``) or ``timeout_s``: the ids still not final."""
    deadline = time.monotonic() + timeout_s
    left = list(flow_run_ids)
    while left and time.monotonic() < deadline:
        left = [r for r in left if not is_final(r, rec, crashed_settle_s)]
        if left:
            time.sleep(5)
    return left


def _cli(rec: Recorder, system: System, action: str, argv: list[str], timeout: float = 900,
         flow_run_id: str | None = None) -> subprocess.CompletedProcess | None:
    started = now()
    try:
        run = subprocess.run(argv, cwd=REPO, env=system.env(), capture_output=True, text=True, timeout=timeout)
        rc, out = run.returncode, run.stdout + run.stderr
    except subprocess.TimeoutExpired as e:
        run, rc, out = None, -9, f"timed out after {timeout} s: {e.stdout or ''}{e.stderr or ''}"
    if run is not None and flow_run_id is None:
        match = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout)
        flow_run_id = match.group(1) if match else None
    rec.write("operator", {"at": started, "action": action, "argv": argv, "rc": rc, "output_tail": out[-2000:],
                           "flow_run_id": flow_run_id})
    rec.log(f"operator {action}: rc {rc}: {out.strip().splitlines()[-1:] if out.strip() else ''}")
    return run


def run_gc(system: System, rec: Recorder) -> None:
    _cli(rec, system, "gc", [sys.executable, "-m", "posttrain", "gc", *system.store_args(),
                             "--keep-runs", str(GC_KEEP_RUNS)])


class Operator(Background):
    """The planned rollbacks (``posttrain rollback --to previous``) and promotions (the promote
    deployment, with the identity staging serves as the candidate)."""

    def __init__(self, system: System, rec: Recorder, actions: list[PlannedAction], t0: float) -> None:
        super().__init__("operator", t0)
        self.system, self.rec, self.actions = system, rec, actions
        self.promote_runs: list[str] = []

    def _loop(self) -> None:
        for action in self.actions:
            if self._until(action.at_s):
                return
            getattr(self, action.action)()

    def rollback(self) -> None:
        prod = self.system.gateways["production"]
        _cli(self.rec, self.system, "rollback",
             [sys.executable, "-m", "posttrain", "rollback", *self.system.store_args(), "--deployment",
              prod.deployment_id, "--api-url", prod.url, "--token-env", "SOAK_GATEWAY_TOKEN", "--to", "previous",
              "--timeout", "300", "--reason", "soak: the operator rolls back"])

    def promote(self) -> None:
        staging = self.system.gateways["staging"]
        identity = None
        request = urllib.request.Request(f"{staging.url}/health",
                                         headers={"Authorization": f"Bearer {self.system.token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                identity = json.loads(r.read()).get("snapshotIdentity")
        except OSError as e:
            self.rec.log(f"operator promote: staging's /health: {e}")
        if identity is None:
            why = "nothing to promote: staging serves its boot weights (or did not answer)"
            self.rec.write("operator", {"at": now(), "action": "promote", "argv": [], "rc": -1, "flow_run_id": None,
                                        "output_tail": why})
            self.rec.log(f"operator promote: {why}")
            return
        params = {"candidate": identity, "eval_dataset": str(self.system.eval_dataset),
                  "eval_reward_funcs": REWARDS, **GATE}
        run = _cli(self.rec, self.system, "promote",
                   [sys.executable, "-m", "prefect", "deployment", "run", self.system.deployment("promote"),
                    "--params", json.dumps(params)], timeout=300)
        if run is not None:
            match = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout)
            if match:
                self.promote_runs.append(match.group(1))
