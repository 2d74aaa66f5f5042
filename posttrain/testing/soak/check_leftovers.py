"""Check 6, ``leftovers``: nothing the soak started is left behind, and the metrics agree with the history.

- store leases: any publisher, gc or deployment lease still in the store after the soak (each
  operation deletes its own; one left behind was held by a process killed mid-step and never
  replaced by a retry of the same holder);
- jobs: every job marker in the run folders (a ``JobRecord``: ``job_id``, ``backend``, ``pgid``)
  whose job still runs: a local job's process group alive, a Slurm job in ``squeue``; and any
  Slurm job whose working folder is under the soak's folders;
- processes: every process whose command line names the soak folder or a run folder, except
  this checker, its parents and the soak's standing services (``SERVICES``: the gateways, Prefect's
  server and worker, the store and its proxy, the database, Slurm's daemons), which are noted;
- metrics: each production gateway's ``posttrain_replica_snapshot_info`` names its history's
  champion on every replica (when the gateway answers ``/metrics``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from posttrain.testing.soak.check_context import Context
from posttrain.testing.soak.check_history import gateway_get
from posttrain.testing.soak.check_model import CheckResult, finite
from posttrain.testing.soak.check_store import DEPLOYMENT_LEASE_RE, GC_LEASE_RE, RUN_KEY_RE
from posttrain.testing.soak.operator import ROUND_TIMEOUT_S
from posttrain.trainer.rounds import HEARTBEAT_FILE

SERVICES = ("posttrain serve", "posttrain.serve", "prefect server", "prefect worker", "prefect.server",
            "weed ", "faultproxy", "fault_proxy", "postgres", "slurmd", "slurmctld", "slurmdbd", "soak_check")
JOB_KEYS = {"job_id", "run_id", "name", "backend", "output_dir"}
INFO_RE = re.compile(r'^posttrain_replica_snapshot_info\{([^}]*)\}\s+(\S+)', re.M)
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# A trainer past its round timeout sees it at its next look at the heartbeat and exits: this long at most
TRAINER_EXIT_S = 30.0


def check_leftovers(ctx: Context) -> CheckResult:
    res = CheckResult("leftovers")
    _leases(ctx, res)
    roots = [ctx.soak.dir.resolve(), *(p.resolve() for p in ctx.soak.run_dirs())]
    _metrics(ctx, res)
    if not ctx.live:
        res.skipped.append("jobs and processes (not live)")
        return res
    _jobs(res, roots)
    _processes(res, roots)
    return res


def _leases(ctx: Context, res: CheckResult) -> None:
    for key in sorted(ctx.store.sizes):
        m = RUN_KEY_RE.fullmatch(key)
        if not ((m and m.group(2).startswith("leases/")) or DEPLOYMENT_LEASE_RE.fullmatch(key)
                or GC_LEASE_RE.fullmatch(key)):
            continue
        res.items += 1
        try:
            rec = ctx.store.json(key)
        except ValueError:
            rec = {}
        rec = rec if isinstance(rec, dict) else {}
        res.bad(f"store lease left behind: {key} (holder {rec.get('holder')} {rec.get('run') or ''}, pid "
                f"{rec.get('pid')} on {rec.get('host')}, expires_at {rec.get('expires_at')}, pending "
                f"{rec.get('pending')})")


def _markers(roots: list[Path], depth: int = 5) -> list[tuple[Path, dict]]:
    out = []

    def walk(p: Path, d: int) -> None:
        try:
            entries = list(p.iterdir())
        except OSError:
            return
        for e in entries:
            if e.is_dir() and not e.is_symlink() and d > 0 and not e.name.startswith("checkpoint-"):
                walk(e, d - 1)
            elif e.suffix == ".json" and "job" in e.name:
                try:
                    data = json.loads(e.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(data, dict) and JOB_KEYS <= set(data):
                    out.append((e, data))

    for r in roots[1:]:
        walk(r, depth)
    return out


def _squeue() -> list[str] | None:
    if shutil.which("squeue") is None:
        return None
    try:
        done = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%k|%Z"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


def _under(path: str, roots: list[Path]) -> bool:
    return any(path == str(r) or path.startswith(str(r) + "/") for r in roots)


def _still_runs(job: dict) -> str | None:
    """How the job of a marker still runs (read now), or None when it has ended."""
    if job.get("backend") == "local" and finite(job.get("pgid")) and job["pgid"] > 1:
        try:
            os.killpg(int(job["pgid"]), 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return f"process group {job['pgid']}"
    if job.get("backend") == "slurm":
        queued = {line.split("|", 1)[0]: line for line in _squeue() or []}
        if str(job.get("job_id")) in queued:
            return f"in squeue: {queued[str(job['job_id'])]}"
    return None


def _jobs(res: CheckResult, roots: list[Path]) -> None:
    for path, job in _markers(roots):
        res.items += 1
        how = _still_runs(job)
        heartbeat = path.parent / "rounds" / HEARTBEAT_FILE
        if how is not None and heartbeat.is_file():
            # A GRPO run's resident trainer outlives a run that failed, for a retry to continue it; the
            # product's word is that it ends by itself round_timeout_s after the flow's last heartbeat.
            # Held to that: waited for until then, a violation after.
            deadline = heartbeat.stat().st_mtime + ROUND_TIMEOUT_S + TRAINER_EXIT_S
            while how is not None and time.time() < deadline:
                time.sleep(2.0)
                how = _still_runs(job)
            if how is None:
                res.notes.append(f"the resident job {job.get('name')} ({path}) ended by itself "
                                 f"{time.time() - heartbeat.stat().st_mtime:.0f}s after its flow's last heartbeat")
                continue
            how += f", {time.time() - heartbeat.stat().st_mtime:.0f}s after its flow's last heartbeat"
        if how is not None:
            res.bad(f"{job.get('backend')} job {job.get('name')} ({path}) still runs: {how}")
    queue = _squeue()
    if queue is None:
        res.notes.append("squeue is not available: no Slurm jobs looked at")
        return
    for line in queue:
        parts = line.split("|")
        if len(parts) >= 5 and _under(parts[4], roots):
            res.items += 1
            res.bad(f"Slurm job left behind: {line}")


def _ancestors() -> set[int]:
    out, pid = {os.getpid()}, os.getpid()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        out.add(pid)
    return out


def _processes(res: CheckResult, roots: list[Path]) -> None:
    mine = _ancestors()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in mine:
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not cmd or not any(str(r) in cmd for r in roots):
            continue
        res.items += 1
        if any(s in cmd for s in SERVICES):
            res.notes.append(f"service still running (expected): pid {proc.name}: {cmd[:160]}")
        else:
            res.bad(f"process left behind: pid {proc.name}: {cmd[:200]}")


def _metrics(ctx: Context, res: CheckResult) -> None:
    for role, entry in sorted(ctx.soak.productions().items()):
        dep = ctx.soak.history_of(entry, role)[0]
        rep = ctx.histories.get(dep)
        champion = rep.champion if rep is not None else None
        text, source = _metrics_text(ctx, role, entry)
        if text is None:
            res.notes.append(f"{role}: no /metrics to compare ({source})")
            continue
        for labels, value in INFO_RE.findall(text):
            res.items += 1
            lab = dict(LABEL_RE.findall(labels))
            try:
                v = float(value)
            except ValueError:
                v = float("nan")
            if not finite(v) or v != 1.0:
                res.bad(f"{role}: posttrain_replica_snapshot_info{{{labels}}} is {value}, not 1")
            elif (lab.get("identity") or None) != champion:
                res.bad(f"{role}: replica {lab.get('replica')} reports identity {lab.get('identity') or '(boot)'} in "
                        f"its metrics ({source}), the history's champion is {champion or 'none'}")


def _metrics_text(ctx: Context, role: str, entry: dict) -> tuple[str | None, str]:
    """The production gateway's metrics: live when it answers, else the file the driver saved at quiesce."""
    if ctx.live and entry.get("gateway_url"):
        try:
            status, body = gateway_get(ctx, entry, "/metrics")
            if status == 200:
                return body.decode(errors="replace"), "live /metrics"
        except OSError:
            pass
    name = (entry.get("final") or {}).get("metrics_file")
    if not name:
        return None, "the gateway is stopped and no metrics were saved at quiesce"
    try:
        return (ctx.soak.dir / name).read_text(errors="replace"), f"{name} at quiesce"
    except OSError as e:
        return None, f"{name}: {e}"
