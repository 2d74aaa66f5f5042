"""How cost grows with the round number: a long GRPO run, measured round by round.

The ``grpo`` flow (tiny model, toy prompts, a folder store, the reference inference server, a
resident trainer, ``max_staleness`` 1) runs in a process of its own against a Prefect server this
benchmark starts on a free port, on PostgreSQL (``--db postgres``, the default) or SQLite, both
under a temporary folder, stopped at the end. A round ends when the flow writes its rounds table
(the flow module's ``round_table``, wrapped); per round:

  wall s         end of the previous round to this one's (round 1: from the flow's call, set-up in)
  flow RSS MiB   the flow process's resident memory at the round's end
  DB rows        rows the Prefect database wrote in the round (inserted + updated + deleted), counted
                 exactly by statement triggers on every Prefect table, installed once the server
                 has migrated (SQLite: row triggers); the recorder batches a second, so a round's
                 last writes can land in the next
  artifact B     bytes of artifact creates and updates the flow sent to the API in the round
  run-folder B   bytes the run added to its folders (shared/: run folder, rounds, policy; the
                 job folder) in the round
  store B        bytes the store gained in the round (the published snapshots)

Goal: rounds 190-200 cost <= 1.1x rounds 1-10 in each (round 1 excluded from the baseline: it
carries the set-up); nothing per round grows with the round number.

    .venv/bin/python bench/growth.py rounds [--rounds 200] [--shards 8] [--db postgres]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from growth_common import ROOT, machine, plot, python, ratio, save, table

GOAL = 1.1
METRICS = {"wall_s": "wall s", "rss_mib": "flow RSS MiB", "db_rows": "DB rows", "artifact_bytes": "artifact B",
           "folder_bytes": "run-folder B", "store_bytes": "store B"}
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LOG_TABLE = "bench_writes"  # the triggers' log: one row per statement (SQLite: per row) and table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--prompts-per-shard", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--port", type=int, default=0, help="the Prefect server's port (0: a free one)")
    p.add_argument("--state-dir", type=Path, help="the servers' folders (default: a new temporary folder, removed)")
    p.add_argument("--db", choices=("postgres", "sqlite"), default="postgres", help="the Prefect server's database")
    p.add_argument("--live-window", type=int, help="the live artifacts' windows (default: the product's, "
                   "20 table rows and 60 curve points); smaller, a short run reaches them")


# --- the parent: servers, the child, the report ---------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_rounds(rounds: int, *, shards: int = 8, prompts_per_shard: int = 2, num_generations: int = 4,
                   max_completion_length: int = 8, port: int = 0, state_dir: Path | None = None,
                   db: str = "postgres", live_window: int | None = None, settle_s: float = 0.0,
                   server_env: dict[str, str] | None = None) -> list[dict]:
    """One GRPO run of ``rounds`` rounds against servers of its own; one row per round (METRICS, and
    the DB rows by table). ``live_window``: the live artifacts' windows (the rounds table's latest
    rows, the reward curve's points) instead of the product's, for a short run that should reach them.
    ``settle_s``: at each round's end, wait until the database wrote nothing for this long (at most 8 times)
    before reading it, so that the server's batched writes count in their own round; ``server_env``: more
    settings for the Prefect server (its services' flush intervals)."""
    own_state = state_dir is None
    state = Path(tempfile.mkdtemp(prefix="posttrain-growth-rounds-")) if own_state else Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o755)  # PostgreSQL runs as its own user when we are root: it must reach its folder
    port = port or free_port()
    env = {**os.environ, **ENV, "POSTTRAIN_SERVICES_DIR": str(state), "PREFECT_UI": "0", "POSTTRAIN_PREFECT_DB": db,
           "PREFECT_PORT": str(port), "POSTTRAIN_PREFECT_DIR": str(state / "prefect"),
           "POSTTRAIN_POSTGRES_DIR": str(state / "postgres"), "POSTGRES_PORT": str(free_port()),
           "POSTTRAIN_BIN_DIR": str(Path(python()).parent), **(server_env or {})}
    for k in ("PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        env.pop(k, None)
    scripts = ROOT / "scripts" / "services"
    stops = []
    try:
        if db == "postgres":
            stops.append("stop-postgres.sh")
            subprocess.run(["bash", str(scripts / "start-postgres.sh")], env=env, check=True, capture_output=True)
        stops.insert(0, "stop-prefect.sh")
        subprocess.run(["bash", str(scripts / "start-prefect.sh")], env=env, check=True, capture_output=True)
        counter = db_counter(db, state)
        counter.install()
        out = state / "rounds.json"
        spec = {"rounds": rounds, "shards": shards, "prompts_per_shard": prompts_per_shard,
                "num_generations": num_generations, "max_completion_length": max_completion_length,
                "db": db, "state": str(state), "out": str(out), "live_window": live_window, "settle_s": settle_s}
        subprocess.run([python(), __file__, json.dumps(spec)], check=True, cwd=ROOT,
                       env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
        return json.loads(out.read_text())
    finally:
        for script in stops:
            subprocess.run(["bash", str(scripts / script)], env=env, capture_output=True)
        if own_state:
            shutil.rmtree(state, ignore_errors=True)


def window_means(rows: list[dict], first: range, last: range) -> list[tuple[str, float, float, float]]:
    """(metric, mean of the ``first`` rounds, of the ``last`` rounds, last / first) per metric; RSS
    is a level, not a per-round cost: its ratio is of the levels."""
    def mean(rs: range, key: str) -> float:
        values = [r[key] for r in rows if r["round"] in rs]
        return sum(values) / len(values) if values else math.nan

    out = []
    for key in METRICS:
        a, b = mean(first, key), mean(last, key)
        out.append((key, a, b, ratio(b, a) if a > 0 else (1.0 if b <= 0 else math.inf)))
    return out


def windows(rounds: int) -> tuple[range, range]:
    """Rounds 4-13 and 190-200 of 200, shrunk for short runs. Rounds 1-3 carry the start-up: round 1
    the flow's set-up and first publish, round 2 samples the base again (max_staleness 1: nothing to
    publish), round 3 waits for the resident trainer's start-up (interpreter, torch, model)."""
    n = max(1, min(10, (rounds - 3) // 2))
    return range(4, 4 + n), range(rounds - n + (n < 10), rounds + 1)


def main(args: argparse.Namespace) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still stop the servers (the finally)
    print(machine(), flush=True)
    t0 = time.perf_counter()
    rows = measure_rounds(args.rounds, shards=args.shards, prompts_per_shard=args.prompts_per_shard,
                          num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                          port=args.port, state_dir=args.state_dir, db=args.db,
                          live_window=args.live_window)
    first, last = windows(args.rounds)
    print(f"\n{len(rows)} rounds in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    summary = window_means(rows, first, last)
    verdicts = [(METRICS[k], a, b, g, "ok" if g <= GOAL else "GROWS") for k, a, b, g in summary]
    table(f"GRPO, {args.rounds} rounds x {args.shards} shards x {args.prompts_per_shard} prompts x "
          f"{args.num_generations} completions, resident trainer, max_staleness 1, Prefect on {args.db}: "
          f"per round, means of rounds {first.start}-{first.stop - 1} and {last.start}-{last.stop - 1} "
          f"(goal: <= {GOAL}x)",
          ["metric", f"rounds {first.start}-{first.stop - 1}", f"rounds {last.start}-{last.stop - 1}", "ratio",
           "verdict"], verdicts)
    grown = [r for r in verdicts if r[-1] != "ok"]
    print(f"verdict: {'every metric within' if not grown else 'over'} {GOAL}x"
          + (f" ({', '.join(r[0] for r in grown)})" if grown else ""), flush=True)
    by_table = db_rows_by_table(rows, first, last)
    if by_table:
        table("DB rows per round by table (means)", ["table", "first", "last"], by_table)
    xs = [r["round"] for r in rows]
    for key, label in METRICS.items():
        plot(f"rounds-{key.replace('_', '-')}", f"{label} per round", "round", {label: (xs, [r[key] for r in rows])},
             label)
    path = save("rounds", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                           "summary": [dict(zip(("metric", "first", "last", "ratio"), s)) for s in summary]})
    print(f"rows: {path.relative_to(ROOT)}")


def db_rows_by_table(rows: list[dict], first: range, last: range) -> list[tuple[str, float, float]]:
    tables = sorted({t for r in rows for t in r.get("db_tables", {})})
    def mean(rs: range, t: str) -> float:
        values = [r.get("db_tables", {}).get(t, 0) for r in rows if r["round"] in rs]
        return sum(values) / max(len(values), 1)
    return [(t, mean(first, t), mean(last, t)) for t in tables]


# --- counting the database's writes ---------------------------------------------------------------

class PostgresCounter:
    """Statement triggers (with transition tables: one log row per statement, holding its row count)
    on every Prefect table; read by psql as the Prefect database's owner."""

    def __init__(self, state: Path) -> None:
        url = (state / "postgres" / "url").read_text().strip()
        self.url = url.replace("postgresql+asyncpg://", "postgresql://")
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"), key=lambda p: p.parts[-3])
        self.psql = str(bins[-1]) if bins else "psql"

    def sql(self, text: str) -> str:
        done = subprocess.run([self.psql, self.url, "-v", "ON_ERROR_STOP=1", "-qtAX", "-c", text],
                              check=True, capture_output=True, text=True)
        return done.stdout

    def install(self) -> None:
        self.sql(f"""
create table if not exists {LOG_TABLE} (id bigserial primary key, tbl text not null, n bigint not null);
create or replace function {LOG_TABLE}_log() returns trigger language plpgsql as $f$
begin
  insert into {LOG_TABLE}(tbl, n) select TG_TABLE_NAME, count(*) from changed having count(*) > 0;
  return null;
end $f$;
do $d$ declare t text; begin
  for t in select tablename from pg_tables where schemaname = 'public'
           and tablename not in ('{LOG_TABLE}', 'alembic_version') loop
    execute format('create trigger bw_i after insert on %I referencing new table as changed '
                   'for each statement execute function {LOG_TABLE}_log()', t);
    execute format('create trigger bw_u after update on %I referencing new table as changed '
                   'for each statement execute function {LOG_TABLE}_log()', t);
    execute format('create trigger bw_d after delete on %I referencing old table as changed '
                   'for each statement execute function {LOG_TABLE}_log()', t);
  end loop;
end $d$;""")

    def totals(self) -> dict[str, int]:
        """Rows written so far, by table (cumulative: a late commit still counts, in the next round)."""
        out = self.sql(f"select tbl, sum(n) from {LOG_TABLE} group by tbl")
        return {t: int(n) for t, n in (line.split("|") for line in out.splitlines() if line)}


class SqliteCounter:
    """Row triggers on every Prefect table of the server's SQLite file, one log row per row written."""

    def __init__(self, state: Path) -> None:
        self.path = state / "prefect" / "home" / "prefect.db"

    def _connect(self):
        import sqlite3

        return sqlite3.connect(self.path, timeout=30)

    def install(self) -> None:
        with self._connect() as con:
            con.execute(f"create table if not exists {LOG_TABLE} (id integer primary key, tbl text not null)")
            names = [n for (n,) in con.execute("select name from sqlite_master where type = 'table' and name not like "
                                               f"'sqlite_%' and name not in ('{LOG_TABLE}', 'alembic_version')")]
            for t in names:
                for op in ("insert", "update", "delete"):
                    con.execute(f'create trigger "bw_{op}_{t}" after {op} on "{t}" begin '
                                f"insert into {LOG_TABLE}(tbl) values ('{t}'); end")

    def totals(self) -> dict[str, int]:
        with self._connect() as con:
            return dict(con.execute(f"select tbl, count(*) from {LOG_TABLE} group by tbl").fetchall())


def db_counter(db: str, state: Path):
    return PostgresCounter(state) if db == "postgres" else SqliteCounter(state)


# --- the child: the flow, its rounds measured -----------------------------------------------------

ARTIFACT_WRITE = re.compile(r"/artifacts/?(?:[0-9a-f-]{36})?$")


class ArtifactBytes:
    """Bytes of artifact creates (POST /artifacts/) and updates (PATCH /artifacts/{id}) the process's
    Prefect clients send, counted at httpx's transports."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()
        import httpx

        sync_send, async_send = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request
        count = self.count

        def send(transport, request):
            count(request)
            return sync_send(transport, request)

        async def asend(transport, request):
            count(request)
            return await async_send(transport, request)

        httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request = send, asend

    def count(self, request) -> None:
        if request.method in ("POST", "PATCH") and ARTIFACT_WRITE.search(request.url.path):
            with self._lock:
                self.total += len(request.content)


def folder_bytes(*folders: Path) -> int:
    total = 0
    for folder in folders:
        for dirpath, _, files in os.walk(folder):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass  # removed while walking (a checkpoint rotated, a temporary file renamed)
    return total


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


class RoundMeter:
    """Cumulative readings at each round's end; rows are their differences. The meter's own time (the
    database query, the folder walks) is left out of the rounds' wall time."""

    def __init__(self, counter, artifacts: ArtifactBytes, folders: list[Path], store: Path, settle_s: float = 0.0) -> None:
        self.counter, self.artifacts, self.folders, self.store = counter, artifacts, folders, store
        self.settle_s = settle_s
        self.rows: list[dict] = []
        self.last = self.reading()
        self.resumed = time.perf_counter()

    def reading(self) -> dict:
        return {"db": self.counter.totals(), "artifact": self.artifacts.total,
                "folder": folder_bytes(*self.folders), "store": folder_bytes(self.store)}

    def round_ended(self) -> None:
        ended = time.perf_counter()
        if self.settle_s:  # the round's rows written, not left for the next round to count
            seen = self.counter.totals()
            for _ in range(8):
                time.sleep(self.settle_s)
                seen, before = self.counter.totals(), seen
                if seen == before:
                    break
        now = self.reading()
        tables = {t: n - self.last["db"].get(t, 0) for t, n in now["db"].items() if n - self.last["db"].get(t, 0)}
        self.rows.append({"round": len(self.rows) + 1, "wall_s": ended - self.resumed, "rss_mib": rss_mib(),
                          "db_rows": sum(tables.values()), "artifact_bytes": now["artifact"] - self.last["artifact"],
                          "folder_bytes": now["folder"] - self.last["folder"],
                          "store_bytes": now["store"] - self.last["store"], "db_tables": tables})
        self.last = now
        self.resumed = time.perf_counter()


def child(spec: dict) -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT))
    import secrets

    import torch
    from inference_server import start_inference

    import posttrain.pipeline.flows.grpo as grpo_module
    import posttrain.pipeline.tasks.report as report
    from posttrain.cluster import LocalConfig
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.models.tiny import build_tiny_model
    from posttrain.pipeline.blocks import LocalCluster
    from posttrain.pipeline.deployments.embedded import DEFAULT, save_default_blocks
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.pipeline.settings import GrpoSettings

    torch.set_num_threads(1)
    work = Path(spec["state"]) / "work"
    work.mkdir(parents=True, exist_ok=True)
    base = build_tiny_model(work / "tiny-base", seed=0)
    prompts = spec["shards"] * spec["prompts_per_shard"]
    dataset = write_toy_jsonl(work / "prompts.jsonl", n=max(64, prompts * spec["rounds"]), seed=0, task="mixed")
    store, shared, jobs = work / "store", work / "shared", work / "jobs"
    token = secrets.token_urlsafe(16)
    server, url = start_inference(base, store, work, token)
    try:
        save_default_blocks(store_dir=store, server_url=url, deployment_id="dep-bench", model="tiny", token=token)
        LocalCluster(settings=LocalConfig(folder=str(jobs), poll_interval_s=0.2,
                                          env={k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
                     ).save(DEFAULT, overwrite=True)
        settings = GrpoSettings(
            run_name="growth-rounds", base_model=str(base), dataset=str(dataset), shared_dir=str(shared),
            rounds=spec["rounds"], shards=spec["shards"], prompts_per_round=prompts, trainer_job="resident",
            max_staleness=1, watch_poll_s=0.2,
            rollout={"num_generations": spec["num_generations"], "max_completion_length": spec["max_completion_length"],
                     "reward_funcs": ["posttrain.rewards:length_reward", "posttrain.rewards:format_reward"]},
            trainer={"learning_rate": 1e-3, "use_cpu": True, "seed": 0, "report_to": ["none"]})
        meter = RoundMeter(db_counter(spec["db"], Path(spec["state"])), ArtifactBytes(), [shared, jobs], store,
                           settle_s=spec.get("settle_s") or 0.0)
        if spec.get("live_window"):
            report.LIVE_TABLE_ROWS = report.CURVE_POINTS = spec["live_window"]
        round_table = grpo_module.round_table

        def measured_round_table(*args, **kwargs):
            round_table(*args, **kwargs)
            if not kwargs.get("whole"):  # written once a round, at the round's end (and whole once, after the last)
                meter.round_ended()

        grpo_module.round_table = measured_round_table
        grpo_module.grpo(**to_parameters(settings))
    finally:
        server.terminate()
        server.wait(30)
    Path(spec["out"]).write_text(json.dumps(meter.rows))


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
