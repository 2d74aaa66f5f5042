"""The injector: the planned faults, one after another, at their times (a fault that runs past the
next one's time delays it; ``faults.jsonl`` records when each really started and ended). Each fault
undoes itself (the proxy forwards again, the disk is emptied, the service started again) or leaves
the restart to a supervisor, as a site's systemd would."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from posttrain.testing.soak.processes import cmdline, kill_at_once, processes_matching
from posttrain.testing.soak.record import Background, Recorder, now
from posttrain.testing.soak.schedule import PlannedFault
from posttrain.testing.soak.system import System, prefect_healthy, service_script

TRAINER_WAIT_S = 90.0  # how long trainer_kill waits for a trainer to run
FILLER = ".soak-spool-full"


def _kind_of(line: str, name: str) -> str | None:
    """nightly or grpo: the run kind of a trainer's command line, from its job folder, named after the run
    and cut short (``soak-2-1203161602-nigh-3784b7ce``)."""
    cut = line.split(f"{name}-", 1)[1].split("-", 1)[0] if f"{name}-" in line else ""
    return next((kind for kind in ("nightly", "grpo") if cut and kind.startswith(cut)), None)


class Injector(Background):
    def __init__(self, system: System, rec: Recorder, faults: list[PlannedFault], t0: float) -> None:
        super().__init__("injector", t0)
        self.system, self.rec, self.faults = system, rec, faults
        self.counts: dict[str, int] = {}
        self._handlers: dict[str, Callable[[PlannedFault], tuple[bool, str]]] = {
            "worker_kill": self.worker_kill, "trainer_kill": self.trainer_kill, "store_outage": self.store_outage,
            "serve_kill": self.serve_kill, "prefect_restart": self.prefect_restart,
            "postgres_restart": self.postgres_restart, "spool_full": self.spool_full}

    def stop(self) -> None:
        """No fault starts after this; the one under way ends as planned (it undoes itself)."""
        super().stop()

    def _loop(self) -> None:
        for fault in self.faults:
            if self._until(fault.at_s):
                return
            started = now()
            self.rec.log(f"fault {fault.kind} {fault.target} for {fault.duration_s} s (planned at {fault.at_s} s)")
            try:
                injected, detail = self._handlers[fault.kind](fault)
            except Exception as e:  # noqa: BLE001 - a fault that failed to inject is recorded, not fatal
                injected, detail = False, f"the injector failed: {type(e).__name__}: {e}"
            self.rec.write("faults", {"kind": fault.kind, "target": fault.target, "started_at": started,
                                      "ended_at": now(), "detail": detail, "planned_at_s": fault.at_s,
                                      "injected": injected})
            self.rec.log(f"fault {fault.kind} done: {'injected' if injected else 'NOT injected'}: {detail}")
            if injected:
                self.counts[fault.kind] = self.counts.get(fault.kind, 0) + 1

    # ----- the kinds -----
    def worker_kill(self, fault: PlannedFault) -> tuple[bool, str]:
        """The worker and its flow-run processes (``prefect.engine``), SIGKILL at once; the trainers
        they started go on. The supervisor starts a worker again after duration_s."""
        worker = self.system.worker
        hit = worker.kill(fault.duration_s, lambda pid: "prefect.engine" in cmdline(pid))
        if not hit:
            return False, "no worker process was running"
        return True, f"SIGKILL to the worker and {len(hit) - 1} flow-run process(es): pids {hit}"

    def trainer_kill(self, fault: PlannedFault) -> tuple[bool, str]:
        """SIGKILL to the trainer processes (python -m posttrain.trainer, its launcher) of a run of the
        target kind (waited for TRAINER_WAIT_S / 2), else of any run (waited for as long again)."""
        jobs = str(self.system.jobs)
        deadline = time.monotonic() + TRAINER_WAIT_S
        while not self.stopping.is_set():
            trainers = processes_matching("posttrain.trainer", jobs)
            chosen = [p for p in trainers if _kind_of(cmdline(p), self.system.name) == fault.target]
            if not chosen and time.monotonic() > deadline - TRAINER_WAIT_S / 2:  # then any run's trainer
                chosen = trainers
            if chosen:
                lines = {p: cmdline(p)[:160] for p in chosen}
                hit = kill_at_once(chosen)
                return bool(hit), f"SIGKILL to {hit}: {lines}"
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
        return False, f"no trainer ran within {TRAINER_WAIT_S:.0f} s"

    def store_outage(self, fault: PlannedFault) -> tuple[bool, str]:
        store = self.system.store
        store.begin(fault.target)
        try:
            time.sleep(fault.duration_s)
        finally:
            store.end(fault.target)
        return True, f"{fault.target} for {fault.duration_s} s on {store.url}; proxy counters {store.counters()}"

    def serve_kill(self, fault: PlannedFault) -> tuple[bool, str]:
        gw = self.system.gateways[fault.target]
        hit = gw.process.kill(fault.duration_s)
        if not hit:
            return False, f"posttrain serve ({fault.target}) was not running"
        return True, f"SIGKILL to posttrain serve ({fault.target}, pid {hit[0]}); restarted after {fault.duration_s} s"

    def _restart(self, stop: str, start: str, down_s: float, what: str) -> tuple[bool, str]:
        stopped = service_script(stop)
        time.sleep(down_s)
        started = service_script(start)
        detail = f"{stop} rc {stopped.returncode}, down {down_s} s, {start} rc {started.returncode}"
        for _ in range(3):  # as a supervisor would: what it needs first, then the service again
            if started.returncode == 0:
                break
            detail += f": {(started.stderr or started.stdout).strip()[-300:]}"
            time.sleep(5)
            if start == "start-prefect.sh":
                service_script("start-postgres.sh")
            started = service_script(start)
            detail += f"; {start} again: rc {started.returncode}"
        return stopped.returncode == 0, f"{what}: {detail}"

    def prefect_restart(self, fault: PlannedFault) -> tuple[bool, str]:
        return self._restart("stop-prefect.sh", "start-prefect.sh", fault.duration_s, "the Prefect server")

    def postgres_restart(self, fault: PlannedFault) -> tuple[bool, str]:
        injected, detail = self._restart("stop-postgres.sh", "start-postgres.sh", fault.duration_s, "PostgreSQL")
        deadline = time.monotonic() + 60
        while not prefect_healthy() and time.monotonic() < deadline:
            time.sleep(1)
        if not prefect_healthy():  # the supervisor of the Prefect server (systemd at a site) starts it again
            again = service_script("start-prefect.sh")
            detail += f"; the Prefect server did not answer 60 s after: start-prefect.sh rc {again.returncode}"
        return injected, detail

    def spool_full(self, fault: PlannedFault) -> tuple[bool, str]:
        """The runs' tmpfs filled to the last byte for duration_s, then emptied."""
        spool = self.system.spool
        if spool.get("kind") != "tmpfs":
            return False, f"no tmpfs to fill ({spool.get('why')})"
        filler = Path(spool["path"]) / FILLER
        stat = os.statvfs(spool["path"])
        free = stat.f_bavail * stat.f_frsize
        try:
            with open(filler, "wb", buffering=0) as f:
                try:
                    os.posix_fallocate(f.fileno(), 0, free)
                except OSError:
                    pass  # filled as far as it goes
                while True:  # what fallocate left (tmpfs counts whole pages)
                    try:
                        f.write(b"\0" * 65536)
                    except OSError:
                        break
            left = os.statvfs(spool["path"])
            detail = (f"filled {filler} ({free >> 20} MiB); {left.f_bavail * left.f_frsize} bytes left, "
                      f"for {fault.duration_s} s")
            time.sleep(fault.duration_s)
        finally:
            filler.unlink(missing_ok=True)
        return True, detail
