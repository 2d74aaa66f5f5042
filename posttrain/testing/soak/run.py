"""One soak from start to end: set up, run the nights, the operator, the client and the faults for
``minutes``, drain, quiesce, stop what it started, and write ``soak.json`` (the contract in
``posttrain.testing.soak``)."""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from posttrain.testing.soak import TOKEN_ENV
from posttrain.testing.soak.client import Client
from posttrain.testing.soak.faults import Injector
from posttrain.testing.soak.operator import MAX_STALENESS, Nights, Operator, wait_all_final
from posttrain.testing.soak.record import Recorder, now
from posttrain.testing.soak.schedule import Plan
from posttrain.testing.soak.services import OwnServices
from posttrain.testing.soak.system import (
    CRASH_RETRIES,
    MODEL_NAME,
    PREFIX,
    REGION,
    System,
    prefect_healthy,
    service_script,
)

LOCK = Path("/tmp/posttrain-soak.lock")  # one soak at a time on a machine: each restarts the shared services
QUIESCE_S = 15.0  # after the drain: the client keeps asking while hot-loads and probes settle


class Soak:
    def __init__(self, args: argparse.Namespace, plan: Plan, out: Path) -> None:
        self.args, self.plan, self.out = args, plan, out
        self.rec = Recorder(out)
        self.system = System(seed=args.seed, root=out / "work", rec=self.rec, backend=args.backend,
                             spool_mib=args.spool_mib)
        self.own = OwnServices() if args.services == "own" else None
        self.checked: int | None = None  # the checker's exit status, with --check
        self.meta: dict = {"seed": args.seed, "services": args.services, "faults_injected": bool(plan.faults),
                           "minutes": args.minutes, "backend": args.backend, "started_at": now(),
                           "ended_at": None, "prefect_api_url": os.environ.get("PREFECT_API_URL"),
                           "max_staleness": MAX_STALENESS, "work_pool": self.system.name,
                           "gateway_token_env": TOKEN_ENV, "served_model_name": MODEL_NAME,
                           "nights": plan.nights, "night_s": plan.night_s, "unfinished_runs": [],
                           "crashed_settle_s": args.crashed_settle_s, "crash_retries": CRASH_RETRIES}

    def _write_meta(self) -> None:
        s = self.system
        self.meta.update({
            "store": {"endpoint_url": os.environ.get("POSTTRAIN_S3_ENDPOINT"), "bucket": s.bucket, "prefix": PREFIX,
                      "region": REGION},
            "credentials_env": {"access_key": "AWS_ACCESS_KEY_ID", "secret_key": "AWS_SECRET_ACCESS_KEY"},
            "deployments": {role: {"deployment_id": gw.deployment_id, "gateway_url": gw.url, "block": gw.block,
                                   "history": ({"prefix": PREFIX, "deployment": gw.deployment_id}
                                               if role == "production" else None),
                                   "work_dir": str(gw.work_dir), "final": self.meta.get("final", {}).get(role)}
                            for role, gw in s.gateways.items()},
            "run_dirs": [str(s.shared / "runs")], "base_model": str(s.base_model), "spool": s.spool})
        self.rec.write_json("soak.json", {k: v for k, v in self.meta.items() if k != "final"})

    def run(self) -> int:
        with open(LOCK, "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                self.rec.log(f"another soak runs ({lock.read().strip() or '?'}, {LOCK}): waiting for it to end")
                fcntl.flock(lock, fcntl.LOCK_EX)
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()}, folder {self.out}\n")
            lock.flush()
            return self._run()

    def _run(self) -> int:
        t_start = time.monotonic()
        for fault in self.plan.faults:
            self.rec.write("schedule", {"at_s": fault.at_s, "kind": fault.kind, "target": fault.target,
                                        "duration_s": fault.duration_s})
        (self.rec.logs / "plan.txt").write_text(self.plan.describe() + "\n")
        self._write_meta()
        try:
            if self.own is not None:
                self.own.start(self.rec.log)
                self.meta["prefect_api_url"] = os.environ["PREFECT_API_URL"]
            self.system.start()
        except BaseException as e:  # noqa: BLE001 - whatever failed, stop what started, and say why
            self.rec.log(f"setup failed:\n{traceback.format_exc()}")
            self._teardown()
            if self.own is not None:
                self.own.stop(self.rec.log)
            return 130 if isinstance(e, KeyboardInterrupt) else 1
        self._write_meta()
        self.rec.log(f"set up in {time.monotonic() - t_start:.0f} s; the soak begins")
        t0 = time.monotonic()
        prod = self.system.gateways["production"]
        client = Client(self.rec, prod.url, self.system.token, MODEL_NAME, self.args.client_interval_s)
        nights = Nights(self.system, self.rec, self.plan.nights, self.plan.night_s, t0)
        operator = Operator(self.system, self.rec, self.plan.operator, t0)
        injector = Injector(self.system, self.rec, self.plan.faults, t0)
        for part in (client, nights, operator, injector):
            part.start()
        try:
            time.sleep(max(0.0, t0 + self.args.minutes * 60 - time.monotonic()))
            self.rec.log("the soak's time is up: no new runs, no new faults; draining")
            nights.stop()
            operator.stop()
            injector.stop()
            self._services_back()
            runs = list(nights.started) + operator.promote_runs
            left = wait_all_final(runs, self.rec, self.args.drain_s, self.args.crashed_settle_s)
            self.meta["unfinished_runs"] = left
            self.rec.log(f"drained: {len(runs) - len(left)} of {len(runs)} runs ended" +
                         (f"; still not ended: {left}" if left else ""))
            time.sleep(QUIESCE_S)
        except KeyboardInterrupt as e:  # a signal (bench/soak.py): stop here, but stop what was started
            self.meta["interrupted"] = str(e)
            self.rec.log(f"interrupted ({e}): stopping what the soak started")
            for part in (nights, operator, injector):
                part.stopping.set()
        finally:
            client.stop()
            self.meta["final"] = self.system.final_gateway_state() if self.system.gateways else {}
            self._teardown()
        self.meta["ended_at"] = now()
        self.meta["summary"] = {"faults_by_kind": injector.counts, "runs": len(nights.started),
                                "runs_not_started": nights.skipped, "replies": client.sent,
                                "replies_by_status": client.by_status, "wall_s": round(time.monotonic() - t_start, 1),
                                "worker_starts": self.system.worker.starts if self.system.worker else 0,
                                "gateway_starts": {r: g.process.starts for r, g in self.system.gateways.items()}}
        self._write_meta()
        self.rec.log(f"soak done: {self.meta['summary']}; folder {self.out}")
        if self.args.check and not self.meta.get("interrupted"):
            self.checked = self._check()
        if self.own is not None:
            self.own.stop(self.rec.log)
        self.rec.close()
        if self.meta.get("interrupted"):
            return 130
        return 4 if self.checked else 0

    def _check(self) -> int:
        """bench/soak_check.py on the folder, while the system it asks (Prefect, the store) still runs: its
        table and violations go to the log and to check.txt; its exit status (1: violations)."""
        script = Path(__file__).resolve().parents[3] / "bench" / "soak_check.py"
        done = subprocess.run([sys.executable, str(script), str(self.out), "--json", str(self.out / "check.json")],
                              capture_output=True, text=True, timeout=1800)
        (self.out / "check.txt").write_text(done.stdout + done.stderr)
        self.rec.log(f"checker: exit status {done.returncode}\n{done.stdout}{done.stderr[-3000:]}")
        return done.returncode

    def _services_back(self) -> None:
        """The suite's services as they were: a fault may have left one stopped (the restart scripts
        are idempotent)."""
        for script in ("start-postgres.sh", "start-prefect.sh"):
            if script == "start-prefect.sh" and prefect_healthy():
                continue
            run = service_script(script)
            self.rec.log(f"{script}: rc {run.returncode}")

    def _teardown(self) -> None:
        try:
            self.system.stop()
        except Exception:  # noqa: BLE001
            self.rec.log(f"teardown: {traceback.format_exc()}")
        self._services_back()
