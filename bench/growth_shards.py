"""How cost grows with shards: one GRPO round at 8-256 shards on PostgreSQL, against the no-Prefect floor.

Each size runs ``bench/prefect_overhead.py``'s case (the ``grpo`` flow, ``trainer_job: per_round``,
the tiny model, the reference inference server, the floor's rounds before and after the flow) in
this one process, against a Prefect server on PostgreSQL that this module starts on free ports
under a temporary folder and stops at the end. Per size:

  wall, floor   medians over the rounds: the flow's "round s" and the same round without Prefect
  task runs     per round: task runs whose Pending state falls in the round (publish, hot-load, one
                per shard, train-step), read from the server's database
  API calls     per round: HTTP requests of this process to the Prefect API (task-run states travel
                as events over the events websocket, not counted here)
  events        per round: rows of the ``events`` table that occurred in the round
  DB rows       per round: PostgreSQL's pg_stat_user_tables (inserted + updated + deleted rows),
                sampled every 0.25 s and read at the rounds' starts; PostgreSQL publishes a backend's
                counts up to ~10 s late, so a round's last writes may count in the next (the median
                over rounds evens it out); "rows/flow" is the whole flow's, read once settled

A round runs from the call that publishes its policy to the next round's (the last: the final
publish). ``measure_server_rate`` measures what the server sustains: a flow of N trivial tasks
mapped at once, as a round's shards are, timed until the server has recorded every task run
Completed, with the DB rows, events and API calls per task run (for the issue's projection of
500 rounds x 64 shards).

    .venv/bin/python bench/growth.py shards [--shards 8 32 64 128 256] [--rounds 2] [--rate-tasks 64 512]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from growth_common import ROOT, loadavg, machine, plot, ratio, save, table

GOAL = 1.10  # the goal: wall <= 1.10x the floor at every size
SETTLE_S = 11.0  # PostgreSQL publishes an idle backend's row counts after 10 s
FIXED_TASK_RUNS = 3  # per round besides the shards: publish, hot-load, train-step


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", type=int, nargs="+", default=[8, 32, 64, 128, 256], help="shard counts")
    p.add_argument("--rounds", type=int, default=2, help="GRPO rounds per size (the floor runs 2x as many)")
    p.add_argument("--prompts-per-shard", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--rate-tasks", type=int, nargs="*", default=[64, 512],
                   help="flows of this many trivial tasks for the server's sustained rate (none: skip)")


# ---------------------------------------------------------------------- services
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Services:
    api_url: str  # the Prefect API
    db_url: str  # its PostgreSQL database (asyncpg's URL)
    ready: Callable[[], None]  # returns once the API answers (its migrations are done)


@contextlib.contextmanager
def prefect_on_postgres() -> Iterator[Services]:
    """A PostgreSQL and a Prefect server on it (scripts/services), on free loopback ports under a
    temporary folder; yields once PostgreSQL answers (``ready()`` waits for the Prefect server, which
    migrates its database meanwhile); stops both and removes the folder. Sets the environment that
    prefect_overhead reads to label a case and find the servers' processes."""
    state = Path(tempfile.mkdtemp(prefix="growth-shards-"))
    state.chmod(0o755)  # as root, PostgreSQL runs as `postgres`: it must reach its folder
    scripts = ROOT / "scripts" / "services"
    port = free_port()
    labels = {"POSTTRAIN_PREFECT_DB": "postgres", "POSTTRAIN_POSTGRES_DIR": str(state / "postgres"),
              "POSTTRAIN_PREFECT_DIR": str(state / "prefect")}
    env = {**os.environ, **labels, "POSTTRAIN_SERVICES_DIR": str(state), "PREFECT_UI": "0",
           "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent), "POSTGRES_PORT": str(free_port()),
           "PREFECT_PORT": str(port)}
    for name in ("PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        env.pop(name, None)
    saved = {k: os.environ.get(k) for k in labels}
    prefect = None
    try:
        subprocess.run(["bash", str(scripts / "start-postgres.sh")], env=env, check=True)
        prefect = subprocess.Popen(["bash", str(scripts / "start-prefect.sh")], env=env)

        def ready() -> None:
            if prefect.wait() != 0:
                raise RuntimeError(f"start-prefect.sh failed ({prefect.returncode}); see {state / 'prefect'}")

        os.environ.update(labels)
        db_url = (state / "postgres" / "url").read_text().strip().replace("postgresql+asyncpg", "postgresql")
        yield Services(f"http://127.0.0.1:{port}/api", db_url, ready)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if prefect is not None:
            prefect.wait()
        for script in ("stop-prefect.sh", "stop-postgres.sh"):
            subprocess.run(["bash", str(scripts / script)], env=env, capture_output=True)
        shutil.rmtree(state, ignore_errors=True)


@contextlib.contextmanager
def prefect_api(api_url: str) -> Iterator[None]:
    """This process's Prefect client on ``api_url`` (the environment too: prefect_overhead counts the
    requests whose URL starts with $PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api_url
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            try:
                yield
            finally:
                drain_prefect_queues()
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before


def drain_prefect_queues(timeout: float = 60.0) -> None:
    """Send what this process still queues for the server (task runs' state events, logs) before the
    server stops: left queued, they were retried until the process exited, with a "Still processing
    items" traceback in the test command's output."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (EventsWorker, APILogWorker):
        service.drain_all(timeout=timeout, at_exit=False)


class Db:
    """A synchronous asyncpg connection (one thread's)."""

    def __init__(self, url: str) -> None:
        import asyncio

        import asyncpg

        self.loop = asyncio.new_event_loop()
        self.conn = self.loop.run_until_complete(asyncpg.connect(url))

    def value(self, sql: str, *args) -> int:
        return int(self.loop.run_until_complete(self.conn.fetchval(sql, *args)) or 0)

    def writes(self) -> int:
        """Rows inserted, updated and deleted in the database's tables so far (as published)."""
        return self.value("select sum(n_tup_ins + n_tup_upd + n_tup_del) from pg_stat_user_tables")

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()


class WritesSampler:
    """pg_stat_user_tables' written rows every ``period`` s, in a thread: (time, rows) pairs."""

    def __init__(self, db_url: str, period: float = 0.25) -> None:
        self.db_url, self.period = db_url, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        db = Db(self.db_url)
        try:
            while True:
                self.samples.append((time.time(), db.writes()))
                if self._stop.wait(self.period):
                    return
        finally:
            db.close()

    def __enter__(self) -> WritesSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> int:
        """The last sample taken at or before ``t``."""
        return [rows for when, rows in self.samples if when <= t][-1]


# ---------------------------------------------------------------------- the rounds
BOUNDS: list[float] = []  # time.time() of each publish_weights call of the flow: the rounds' starts
_fake_train = False


def install_hooks() -> None:
    """Record the rounds' starts; let a test's train-step return its input checkpoint at once (no step
    job: the round's task runs are the same, the test counts them). Before prefect_overhead times the
    tasks, so that its timing wraps these; once per process."""
    import prefect_overhead

    import posttrain.pipeline.flows.grpo as grpo_module
    from posttrain.pipeline.tasks import training

    if getattr(grpo_module.publish_weights, "_growth_hook", False):
        return
    publish = grpo_module.publish_weights

    def publish_weights(*args, **kwargs):
        BOUNDS.append(time.time())
        return publish(*args, **kwargs)

    publish_weights._growth_hook = True  # type: ignore[attr-defined]
    grpo_module.publish_weights = publish_weights
    step = training.train_step.fn

    def train_step(cluster_ref, run_name, round, trainer, marker, card=None):
        if _fake_train:
            return str(trainer.model_name_or_path)
        return step(cluster_ref, run_name, round, trainer, marker, card=card)

    training.train_step.fn = train_step
    prefect_overhead.instrument()


def case_args(shards: int, rounds: int, floor: bool, **sampling) -> argparse.Namespace:
    return argparse.Namespace(shards=shards, rounds=rounds, floor=floor, prompts_per_shard=sampling.get("prompts_per_shard", 2),
                              num_generations=sampling.get("num_generations", 4),
                              max_completion_length=sampling.get("max_completion_length", 8))


def measure_shards(sizes: list[int], rounds: int, services: Services, *, floor: bool = True,
                   fake_train: bool = False, **sampling) -> list[dict]:
    """A row per shard count: wall and floor (s, medians over rounds; floor NaN without it), and per
    round the task runs, API calls, events and DB rows (medians), and the DB rows of the whole flow."""
    global _fake_train
    import prefect_overhead

    db_url = services.db_url
    with prefect_api(services.api_url):
        install_hooks()
        _fake_train = fake_train
        db = Db(db_url)
        rows = []
        try:
            work = Path(tempfile.mkdtemp(prefix="growth-shards-case-"))
            with prefect_overhead.bench_case(work, services.ready) as case:
                time.sleep(SETTLE_S)  # the blocks' rows published: not the first size's
                for shards in sizes:
                    BOUNDS.clear()
                    before = db.writes()
                    with WritesSampler(db_url) as sampler:
                        summary = prefect_overhead.run(case_args(shards, rounds, floor, **sampling), case)
                    time.sleep(SETTLE_S)  # every backend's counts published
                    rows.append(round_counts(shards, summary, db, sampler, db.writes() - before))
        finally:
            _fake_train = False
            db.close()
    return rows


def round_counts(shards: int, summary: dict, db: Db, sampler: WritesSampler, flow_rows: int) -> dict:
    """The size's row: per round (a round from its publish call to the next), medians over the rounds."""
    import prefect_overhead

    if len(BOUNDS) != summary["rounds"] + 1:
        raise RuntimeError(f"{len(BOUNDS)} publish calls for {summary['rounds']} rounds (+ the final publish)")
    per_round = []
    for start, end in zip(BOUNDS, BOUNDS[1:]):
        lo, hi = _utc(start), _utc(end)
        per_round.append({
            "task runs": db.value("select count(*) from task_run where expected_start_time >= $1 "
                                  "and expected_start_time < $2", lo, hi),
            "events": db.value("select count(*) from events where occurred >= $1 and occurred < $2", lo, hi),
            "api calls": sum(start <= t < end for t, _ in prefect_overhead.CALLS),
            "db rows": sampler.at(end) - sampler.at(start)})
    return {"shards": shards, "rounds": summary["rounds"], "wall s": summary["wall"], "floor s": summary["floor"],
            **{f"{k}/round": statistics.median(r[k] for r in per_round) for k in per_round[0]},
            "db rows/flow": flow_rows, "per round": per_round}


def _utc(t: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC)


# ---------------------------------------------------------------------- the server's rate
def measure_server_rate(tasks: int, services: Services) -> dict:
    """A flow of ``tasks`` trivial tasks mapped at once (the flow's thread pool, as a round's shards):
    seconds until the flow returns and until the server has recorded every task run Completed, the
    task runs per second that makes, and per task run the API calls, events and DB rows."""
    import prefect_overhead
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(name="probe", cache_policy=NO_CACHE)
    def probe(i: int) -> int:
        return i

    @flow(name="server-rate")
    def server_rate(n: int) -> str:
        from prefect.runtime import flow_run

        assert sum(f.result() for f in probe.map(range(n))) == n * (n - 1) // 2
        return flow_run.id

    services.ready()
    with prefect_api(services.api_url):
        prefect_overhead.instrument()
        db = Db(services.db_url)
        try:
            before, calls0, t0 = db.writes(), len(prefect_overhead.CALLS), time.time()
            flow_run_id = server_rate(tasks)
            t_flow = time.time()
            recorded = "select count(*) from task_run where flow_run_id = $1 and state_type = 'COMPLETED'"
            while db.value(recorded, _uuid(flow_run_id)) < tasks:
                if time.time() - t_flow > 300:
                    raise RuntimeError("the server did not record the task runs in 300 s")
                time.sleep(0.05)
            t_recorded = time.time()
            calls = len(prefect_overhead.CALLS) - calls0
            time.sleep(SETTLE_S)
            written = db.writes() - before
            events = db.value("select count(*) from events where occurred >= $1", _utc(t0))
        finally:
            db.close()
    return {"tasks": tasks, "flow s": t_flow - t0, "recorded s": t_recorded - t0,
            "task runs/s": ratio(tasks, t_recorded - t0), "api calls/task run": ratio(calls, tasks),
            "events/task run": ratio(events, tasks), "db rows/task run": ratio(written, tasks)}


def _uuid(value):
    import uuid

    return uuid.UUID(str(value))


# ---------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> None:
    print(machine(), flush=True)
    sampling = {"prompts_per_shard": args.prompts_per_shard, "num_generations": args.num_generations,
                "max_completion_length": args.max_completion_length}
    with prefect_on_postgres() as services:
        rows = measure_shards(args.shards, args.rounds, services, **sampling)
        rates = [measure_server_rate(n, services) for n in args.rate_tasks]
    print(f"\nmachine: {machine()}")
    cells = []
    for r in rows:
        r["wall/floor"] = ratio(r["wall s"], r["floor s"])
        cells.append([r["shards"], r["wall s"], r["floor s"], r["wall/floor"], r["task runs/round"],
                      r["api calls/round"], r["db rows/round"], r["events/round"], r["db rows/flow"],
                      "yes" if r["wall/floor"] <= GOAL else "NO"])
    table(f"One GRPO round against the no-Prefect floor, PostgreSQL ({args.rounds} rounds a size, medians)",
          ["shards", "wall s", "floor s", "wall/floor", "task runs/round", "API calls/round", "DB rows/round",
           "events/round", "DB rows/flow", f"<= {GOAL}x"], cells)
    worst = max(rows, key=lambda r: r["wall/floor"])
    print(f"verdict: {'met' if worst['wall/floor'] <= GOAL else 'NOT met'}: the worst is {worst['wall/floor']:.2f}x "
          f"at {worst['shards']} shards (goal <= {GOAL}x at every size)")
    if rates:
        table("What the Prefect server on PostgreSQL sustains (a flow of N trivial tasks mapped at once)",
              list(rates[0]), [list(r.values()) for r in rates])
    plot("shards", "GRPO round wall / no-Prefect floor", "shards",
         {"wall / floor": ([r["shards"] for r in rows], [r["wall/floor"] for r in rows]),
          f"goal {GOAL}x": ([r["shards"] for r in rows], [GOAL] * len(rows))}, "wall / floor", logx=True)
    path = save("shards", {"rounds": args.rounds, "rows": rows, "server_rate": rates, "load": loadavg()})
    print(f"rows: {path.relative_to(ROOT)}")
