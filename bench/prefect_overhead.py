"""Benchmark: what Prefect costs a GRPO round, against the same round without Prefect.

Runs the ``grpo`` flow (``trainer_job: per_round``) against a Prefect server, with the tiny model,
toy prompts, a folder store, the reference inference server (a ``posttrain serve`` process, as a
deployment runs beside a flow) and a local training process, then the same rounds without Prefect. Every task body of a round is timed by wrapping the
task's function (publish-checkpoint, hot-load, the ``rollout-shard`` tasks, train-step); every API
request of the flow's clients is counted. Per round:

  wall       the round as the flow timed it ("round s" of its table: publish to training step)
  floor      the same round without Prefect: the engine functions the tasks call (publish, hot-load,
             each shard's sampling in a thread of its own, merge, a local step job) in a plain loop,
             run in the same process before and after the flow (the median of those rounds), on the
             same store and inference server; wall / floor is what Prefect costs the user
  bodies     time during which at least one task body ran (union of the body intervals)
  overhead   wall - bodies: time in which only Prefect ran (creating runs, states, results)
  per run    overhead / Prefect task runs of the round (publish, hot-load, one per shard, train)
  sample     sum and union of the shard bodies (they share one inference server)
  503s       API answers "retry later" (SQLite busy); back-offs: those Prefect's client backed off
             on (2, 4, 8 s)
  API calls  requests to the Prefect API during the round (the last round's by endpoint, and
             the requests answered 503, are printed after each case's rounds)

By default it runs a matrix, each case in a process of its own against a server it starts on its
own port and state folder (scripts/services/start-postgres.sh, start-prefect.sh) and stops at the
end: Prefect on PostgreSQL with 8, 32 and 64 shards, then on embedded SQLite with 8 shards. It
prints every case's rounds, then one line per case with the medians over its rounds, its floor,
and the load average (1 min) before and after the case. No assertions. About 12 minutes on 2 CPUs.

    .venv/bin/python bench/prefect_overhead.py [--cases postgres:8,postgres:64,sqlite:8]
        [--rounds 3] [--ports 4320,4321] [--postgres-port 55432] [--state-dir DIR]
    # one case against a server that runs already:
    PREFECT_API_URL=http://127.0.0.1:4200/api POSTTRAIN_PREFECT_DB=sqlite .venv/bin/python \
        bench/prefect_overhead.py --shards 8
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
for k, v in ENV.items():
    os.environ.setdefault(k, v)

_lock = threading.Lock()
BODIES: list[tuple[str, int | None, float, float, int | None]] = []  # (task, round, start, end, shard)
RETRIES_503: list[float] = []
CALLS: list[tuple[float, str]] = []  # (time answered, "METHOD /path") of every Prefect API request
CALLS_503: list[tuple[float, str]] = []  # those answered 503


def count_api_calls() -> None:
    """Record every HTTP exchange of the Prefect clients (sync and async) with the API, ids replaced
    by {id}: counted at httpx's transports, so a request sent again (posttrain's quick retry of a
    503, Prefect's back-off) counts each time."""
    import re

    import httpx

    ids = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    def record(request, response) -> None:
        if not str(request.url).startswith(os.environ.get("PREFECT_API_URL", "")):
            return  # not Prefect's
        path = ids.sub("{id}", request.url.path.split("/api", 1)[-1])
        with _lock:
            CALLS.append((time.time(), f"{request.method} {path}"))
            if response is not None and response.status_code == 503:
                CALLS_503.append((time.time(), f"{request.method} {path}"))

    sync_send, async_send = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request

    def send(self, request):
        response = None
        try:
            response = sync_send(self, request)
            return response
        finally:
            record(request, response)

    async def asend(self, request):
        response = None
        try:
            response = await async_send(self, request)
            return response
        finally:
            record(request, response)

    httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request = send, asend


def timed(task_obj, label: str, round_of, shard_of=None, module=None) -> None:
    """Wrap the task's function so every call records its body interval (a plain function: the
    module's attribute, as the flow looks it up)."""
    inner = getattr(task_obj, "fn", task_obj)
    sig = inspect.signature(getattr(inner, "fn", inner))

    def wrapper(*args, **kwargs):
        named = sig.bind(*args, **kwargs).arguments
        t0 = time.time()
        try:
            return inner(*args, **kwargs)
        finally:
            with _lock:
                BODIES.append((label, round_of(named), t0, time.time(), shard_of(named) if shard_of else None))

    wrapper.__signature__ = sig  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(inner, "__name__", label)
    wrapper.__qualname__ = wrapper.__name__
    wrapper.__module__ = getattr(inner, "__module__", __name__)
    if hasattr(task_obj, "fn"):
        task_obj.fn = wrapper
    else:
        setattr(module, inner.__name__, wrapper)


class Count503(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if "retryable status code 503" in record.getMessage():
            with _lock:
                RETRIES_503.append(record.created)
        return record.levelno >= logging.INFO  # count the debug lines, do not print them


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="postgres:8,postgres:32,postgres:64,sqlite:8",
                    help="comma-separated DB:SHARDS (DB: postgres or sqlite)")
    ap.add_argument("--shards", type=int, help="one case, against $PREFECT_API_URL (no server started)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-shard", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=8)
    ap.add_argument("--ports", default="4320,4321", help="Prefect ports: SQLite-backed, Postgres-backed")
    ap.add_argument("--postgres-port", type=int, default=55432)
    ap.add_argument("--state-dir", default=os.path.join(
        os.environ.get("POSTTRAIN_SERVICES_DIR", "/tmp/posttrain-services"), "bench"))
    ap.add_argument("--summary-json", help=argparse.SUPPRESS)  # a case's child writes its medians here
    args = ap.parse_args()
    if args.shards is not None:
        if not os.environ.get("PREFECT_API_URL"):
            raise SystemExit("--shards runs one case against $PREFECT_API_URL; set it, or run the matrix")
        summary = run(args)
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(summary))
        return
    matrix(args)


def loadavg() -> float:
    return os.getloadavg()[0]


def cpu_seconds(pidfile: Path) -> float:
    """CPU time (user + system) the process of ``pidfile`` and its waited-for children have used."""
    try:
        fields = Path(f"/proc/{pidfile.read_text().strip()}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def own_children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def matrix(args: argparse.Namespace) -> None:
    cases = [(f[0], int(f[1])) for f in (c.split(":") for c in args.cases.split(","))]
    sqlite_port, pg_port = (int(p) for p in args.ports.split(","))
    state = Path(args.state_dir)
    scripts = ROOT / "scripts/services"
    base_env = {**os.environ, "POSTTRAIN_SERVICES_DIR": str(state), "PREFECT_UI": "0",
                "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent), "POSTGRES_PORT": str(args.postgres_port),
                "POSTTRAIN_POSTGRES_DIR": str(state / "postgres")}
    base_env.pop("PREFECT_API_URL", None)
    base_env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    servers = {"sqlite": (sqlite_port, state / "prefect-sqlite"), "postgres": (pg_port, state / "prefect-postgres")}
    started: list[tuple[str, dict]] = []
    results = []
    try:
        for db, shards in cases:
            port, home = servers[db]
            env = {**base_env, "POSTTRAIN_PREFECT_DB": db, "PREFECT_PORT": str(port),
                   "POSTTRAIN_PREFECT_DIR": str(home)}
            if db == "postgres" and not any(s == "stop-postgres.sh" for s, _ in started):
                subprocess.run(["bash", str(scripts / "start-postgres.sh")], env=env, check=True)
                started.append(("stop-postgres.sh", env))
            if not any(s == "stop-prefect.sh" and e["PREFECT_PORT"] == str(port) for s, e in started):
                subprocess.run(["bash", str(scripts / "start-prefect.sh")], env=env, check=True)
                started.insert(0, ("stop-prefect.sh", env))
            out = state / f"summary-{db}-{shards}.json"
            out.unlink(missing_ok=True)
            load0, server0, client0 = loadavg(), cpu_seconds(home / "server.pid"), own_children_cpu()
            child = [sys.executable, __file__, "--shards", str(shards), "--rounds", str(args.rounds),
                     "--prompts-per-shard", str(args.prompts_per_shard), "--num-generations",
                     str(args.num_generations), "--max-completion-length", str(args.max_completion_length),
                     "--summary-json", str(out)]
            rc = subprocess.run(child, env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}).returncode
            summary = json.loads(out.read_text()) if rc == 0 and out.exists() else None
            if summary is not None:  # the whole flow: the rounds, the final publish and hot-load, setup
                summary["server_cpu"] = cpu_seconds(home / "server.pid") - server0
                summary["client_cpu"] = own_children_cpu() - client0
            results.append((db, shards, summary, load0, loadavg()))
    finally:
        for script, env in started:
            subprocess.run(["bash", str(scripts / script)], env=env, capture_output=True)
    header = (f"{'server':>8} {'shards':>6} {'rounds':>6} {'wall s':>7} {'floor s':>7} {'wall/floor':>10} "
              f"{'overhead s':>10} {'overhead %':>10} {'per run ms':>10} {'503s/round':>10} {'back-offs/round':>15} "
              f"{'API calls':>9} {'start gap s':>11} {'end gap s':>9} {'CPU s server/flow':>17} {'load 1m before/after':>21}")
    print(f"\nmedians over the rounds of each case; {os.cpu_count()} CPUs. floor: the same rounds without Prefect "
          "(the engine functions the tasks call, in a plain loop, in the same process, before and after the flow). "
          "start gap: hot-load end to the first sample's start; end gap: last sample's end to training's start; "
          "CPU: the whole case (all rounds, setup, final publish, the floor's rounds)")
    print(header)
    print("-" * len(header))
    for db, shards, m, l0, l1 in results:
        if m is None:
            print(f"{db:>8} {shards:>6}  failed")
            continue
        print(f"{db:>8} {shards:>6} {m['rounds']:>6} {m['wall']:>7.2f} {m['floor']:>7.2f} {m['wall'] / m['floor']:>9.2f}x "
              f"{m['overhead']:>10.2f} {m['overhead_pct']:>10.1f} {m['per_run_ms']:>10.0f} {m['answers_503']:>10.1f} "
              f"{m['retries_503']:>15.1f} {m.get('api_calls', float('nan')):>9.0f} {m['gap_start']:>11.2f} "
              f"{m['gap_end']:>9.2f} {m['server_cpu']:>8.1f}/{m['client_cpu']:<8.1f} {l0:>10.2f}/{l1:<10.2f}")


def floor_rounds(settings, store_dir: Path, server_url: str, token: str, work: Path) -> list[dict[str, float]]:
    """The same rounds without Prefect: the engine functions the flow's tasks call, in a plain loop
    (publish, hot-load, the round's shards in as many threads as shards, merge, a local step job),
    on the same store, inference server and settings. Per round: its wall time, timed as the flow
    times "round s" (publish to the step's checkpoint), and each stage's (STAGES)."""
    from concurrent.futures import ThreadPoolExecutor

    import posttrain.pipeline.flows.grpo as grpo_module
    from posttrain.cluster import LocalConfig
    from posttrain.datasets.staging import read_staged_rows, stage_dataset
    from posttrain.pipeline.blocks import InferenceDeployment, ObjectStore
    from posttrain.pipeline.tasks.publishing import publish_config
    from posttrain.publish import Publisher
    from posttrain.rollouts.rounds import shard_specs
    from posttrain.rollouts.shard import merge_rollouts, run_shard
    from posttrain.rollouts.tokenizers import shard_tokenizer
    from posttrain.runs.job import TrainingSettings
    from posttrain.runs.once import job_name, submit_once, wait_for_result

    # the blocks the flow loads, built here (their methods are the engines the tasks call)
    store = ObjectStore(uri=str(store_dir))
    deployment = InferenceDeployment(api_url=server_url, gateway_url=server_url, deployment_id="dep-bench",
                                     model="tiny", token=token, timeout_s=300, poll_interval_s=0.2)
    settings = settings.model_copy(update={"run_name": f"{settings.run_name}-floor-{work.name}",
                                           "shared_dir": str(work / "shared")})
    run_dir = settings.run_dir
    staged = stage_dataset(settings.dataset, settings.shared_dir)
    rows = read_staged_rows(staged.manifest_path)
    cluster = LocalConfig(folder=str(work / "jobs"))
    current, walls = settings.base_model, []
    with ThreadPoolExecutor(settings.shards) as pool:
        for r in range(settings.rounds):
            t0 = time.perf_counter()
            with Publisher(store.open(), publish_config(settings), owns_store=True) as publisher:
                snapshot = publisher.publish_step(Path(current), r)
            t1 = time.perf_counter()
            with deployment.hot_loader() as loader:
                loaded = loader.hot_load(snapshot.identity,
                                         base_identity=snapshot.base if snapshot.kind == "delta" else None)
            t2, sample_start = time.perf_counter(), time.time()
            round_dir = run_dir / "rounds" / f"{r:04d}"
            specs = shard_specs(rows, round=r, per_round=settings.prompts_per_round, shards=settings.shards,
                                policy_version=r, round_dir=round_dir, identity=loaded.identity)

            starts = []

            def shard(spec, tokenizer_dir=current):
                starts.append(time.perf_counter())
                client = deployment.completions()
                try:
                    return run_shard(spec, settings.rollout, client, shard_tokenizer(tokenizer_dir))
                finally:
                    client.close()

            results = list(pool.map(shard, specs))
            t3, sample_end = time.perf_counter(), time.time()
            rollouts = merge_rollouts([x.path for x in results], round_dir / "rollouts.jsonl")
            trainer = grpo_module.step_trainer(settings, mode="step", model_name_or_path=current, rollouts=rollouts,
                                               max_staleness=0)
            job, _ = submit_once(TrainingSettings.for_pipeline(job_name(f"{settings.run_name}-step"), cluster, trainer),
                                 round_dir / "train-job.json")
            current = str(wait_for_result(job, cluster).checkpoint)
            t4 = time.perf_counter()
            walls.append({"wall": t4 - t0, "publish": t1 - t0, "hot-load": t2 - t1, "sample": t3 - t2,
                          "train": t4 - t3, "shard starts": max(starts) - min(starts),
                          "window": (sample_start, sample_end)})
    return walls


_instrumented = False


def instrument() -> None:
    """Time the task bodies and count the API requests of this process's flows: once per process
    (several cases may run in one process, each clearing the records)."""
    global _instrumented
    if _instrumented:
        return
    from posttrain.pipeline.tasks import publishing, rollouts, training

    client_log = logging.getLogger("prefect.client")
    client_log.setLevel(logging.DEBUG)
    client_log.addFilter(Count503())
    count_api_calls()
    timed(publishing.publish_checkpoint, "publish", lambda a: a["step"])
    timed(publishing.hot_load, "hot-load", lambda a: a["snapshot"].step)
    timed(rollouts.rollout_shard_task, "sample", lambda a: a["spec"].round, lambda a: a["spec"].shard)
    timed(training.train_step, "train", lambda a: a["round"])
    _instrumented = True


@contextlib.contextmanager
def bench_case(work: Path, api_ready=lambda: None):
    """The tiny base model, a folder store, the reference inference server and the default blocks
    (saved to $PREFECT_API_URL once ``api_ready()`` returns) under ``work``: what a case's flow and floor run against. Yields
    (base, store, server process, server URL, token); stops the server and removes ``work`` on leaving."""
    from inference_server import start_inference  # bench/, beside this file

    from posttrain.cluster import LocalConfig
    from posttrain.models.tiny import build_tiny_model
    from posttrain.pipeline.blocks import LocalCluster
    from posttrain.pipeline.deployments.embedded import DEFAULT, save_default_blocks

    work.mkdir(parents=True, exist_ok=True)
    base = build_tiny_model(work / "tiny-base", seed=0)
    store = work / "store"
    token = secrets.token_urlsafe(16)
    # a `posttrain serve` process, as an inference deployment is: in this process its request
    # handling would queue on the GIL behind the flow's Python (and the floor's)
    server, server_url = start_inference(base, store, work, token, core=None)
    try:
        api_ready()  # a Prefect server may start meanwhile
        save_default_blocks(store_dir=store, server_url=server_url, deployment_id="dep-bench", model="tiny",
                            token=token)
        LocalCluster(settings=LocalConfig(folder=str(work / "jobs"))).save(DEFAULT, overwrite=True)
        yield base, store, server, server_url, token
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, case: tuple | None = None) -> dict:
    """One case: ``args.rounds`` GRPO rounds of ``args.shards`` shards and the floor's rounds (none when
    ``args.floor`` is False), against ``case`` (a ``bench_case``'s; None: one of its own). Prints the
    rounds; returns the medians, with each round's row under "per_round"."""
    from cpu_sampler import CpuSampler, pid_in  # bench/, beside these files

    import posttrain.pipeline.flows.grpo as grpo_module
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.pipeline.settings import GrpoSettings

    instrument()
    for records in (BODIES, RETRIES_503, CALLS, CALLS_503):
        records.clear()
    with contextlib.ExitStack() as stack:
        if case is None:
            case = stack.enter_context(bench_case(Path(tempfile.mkdtemp(prefix="posttrain-prefect-bench-"))))
        base, store, server, server_url, token = case
        work = Path(tempfile.mkdtemp(prefix=f"shards-{args.shards}-", dir=store.parent))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        prompts = args.shards * args.prompts_per_shard
        dataset = write_toy_jsonl(work / "prompts.jsonl", n=max(prompts, 16), seed=0, task="mixed")
        settings = GrpoSettings(
            run_name=f"bench-{int(time.time())}-{args.shards}", base_model=str(base), dataset=str(dataset),
            shared_dir=str(work / "shared"), rounds=args.rounds, prompts_per_round=prompts, shards=args.shards,
            rollout={"num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
                     "reward_funcs": ["posttrain.rewards:correctness_reward"]},
            trainer={"learning_rate": 1e-3, "use_cpu": True},
            trainer_job="per_round",  # a round is publish, hot-load, sample, one step job: as the floor's
        )
        # where each process spends CPU while the shards sample (the flow's Python, the inference
        # server, the Prefect server, its database)
        prefect_dir = Path(os.environ.get("POSTTRAIN_PREFECT_DIR", ""))
        postgres_dir = Path(os.environ.get("POSTTRAIN_POSTGRES_DIR", ""))
        sampler = CpuSampler({"bench": os.getpid(), "inference": server.pid,
                              "prefect": pid_in(prefect_dir / "server.pid"),
                              "postgres": pid_in(postgres_dir / "data" / "postmaster.pid")},
                             with_children=("inference", "prefect", "postgres"))
        sampler.start()
        # the floor's rounds before and after the flow's: neither side has all the warm caches
        with_floor = getattr(args, "floor", True)
        floor = floor_rounds(settings, store, server_url, token, work / "floor-before") if with_floor else []
        t0 = time.perf_counter()
        report = grpo_module.grpo(**to_parameters(settings))
        flow_wall = time.perf_counter() - t0
        if with_floor:
            floor += floor_rounds(settings, store, server_url, token, work / "floor-after")
        sampler.stop()

    runs_per_round = 1 + 1 + args.shards + 1  # publish, hot-load, a task per shard, train
    header = (f"{'round':>5} {'wall s':>7} {'bodies s':>8} {'overhead s':>10} {'overhead %':>10} "
              f"{'runs':>4} {'per run ms':>10} {'per shard ms':>12} {'sample sum s':>12} {'sample union s':>14} "
              f"{'503s':>4} {'back-offs':>9} {'gaps s: pub>load load>sample sample>train':>42}")
    print()
    print(f"GRPO, {args.shards} shards x {args.prompts_per_shard} prompts x {args.num_generations} completions, "
          f"{args.rounds} rounds, Prefect API {os.environ['PREFECT_API_URL']} "
          f"(POSTTRAIN_PREFECT_DB={os.environ.get('POSTTRAIN_PREFECT_DB', 'sqlite')})")
    print(header)
    print("-" * len(header))
    rows, stages = [], []
    per_round_calls: list[list[str]] = []
    for row in report.rounds:
        r = row["round"]
        bodies = [b for b in BODIES if b[1] == r]
        outer = [(s, e) for _, _, s, e, _ in bodies]
        samples = [b for b in bodies if b[0] == "sample"]
        window = (min(s for s, _ in outer), max(e for _, e in outer))
        retries = sum(window[0] <= t <= window[1] for t in RETRIES_503)
        answers = sum(window[0] <= t <= window[1] for t, _ in CALLS_503)
        calls = [c for t, c in CALLS if window[0] <= t <= window[1]]
        per_round_calls.append(calls)
        wall = row["round s"]
        busy = union(outer)
        overhead = wall - busy
        # where the overhead sits: publish end -> hot-load start, hot-load end -> first sample start
        # (shard task runs created), last sample end -> training start (shard results gathered)
        first = {label: min(s for lb, _, s, _, _ in bodies if lb == label) for label in ("hot-load", "sample", "train")}
        last = {label: max(e for lb, _, _, e, _ in bodies if lb == label) for label in ("publish", "hot-load", "sample")}
        gaps = (first["hot-load"] - last["publish"], first["sample"] - last["hot-load"], first["train"] - last["sample"])
        print(f"{r:>5} {wall:>7.2f} {busy:>8.2f} {overhead:>10.2f} {100 * overhead / wall:>10.1f} "
              f"{runs_per_round:>4} {1000 * overhead / runs_per_round:>10.0f} {1000 * overhead / args.shards:>12.0f} "
              f"{sum(e - s for _, _, s, e, _ in samples):>12.2f} {union([(s, e) for _, _, s, e, _ in samples]):>14.2f} "
              f"{answers:>4} {retries:>9} "
              f"{gaps[0]:>12.2f} {gaps[1]:>12.2f} {gaps[2]:>12.2f}")
        stages.append({"wall": wall, "publish": sum(e - s for lb, _, s, e, _ in bodies if lb == "publish"),
                       "hot-load": sum(e - s for lb, _, s, e, _ in bodies if lb == "hot-load"),
                       "sample": union([(s, e) for _, _, s, e, _ in samples]),
                       "train": sum(e - s for lb, _, s, e, _ in bodies if lb == "train"),
                       # first to last shard body start: how staggered the shards reach the server
                       "shard starts": max(s for _, _, s, _, _ in samples) - min(s for _, _, s, _, _ in samples),
                       "window": (min(s for _, _, s, _, _ in samples), max(e for _, _, _, e, _ in samples))})
        rows.append({"wall": wall, "overhead": overhead, "overhead_pct": 100 * overhead / wall,
                     "per_run_ms": 1000 * overhead / runs_per_round,
                     "retries_503": retries, "answers_503": answers, "api_calls": len(calls), "gap_start": gaps[1], "gap_end": gaps[2]})
    from collections import Counter

    print(f"API requests per round (median {statistics.median(len(c) for c in per_round_calls)}); "
          f"the last round's by endpoint:")
    for call, n in Counter(per_round_calls[-1]).most_common():
        print(f"  {n:>5}  {call}")
    if CALLS_503:
        print("answered 503 (whole flow): " + ", ".join(f"{n} {c}" for c, n in Counter(c for _, c in CALLS_503).most_common()))
    print(f"the same rounds without Prefect (floor_rounds, {args.rounds} before the flow and {args.rounds} after), "
          "wall s: " + " ".join(f"{x['wall']:.2f}" for x in floor))
    # where the flow's round is longer than the floor's: each stage's median, side by side (the flow's
    # train stage is the train-step task's body; the floor's includes merging the shards' rollouts)
    shown = [k for k in stages[0] if k != "window"]
    print("stage medians, s:   " + "  ".join(f"{k:>12}" for k in shown))
    for name, runs in (("flow", stages), ("floor", floor)) if floor else (("flow", stages),):
        print(f"  {name:<17} " + "  ".join(f"{statistics.median(x[k] for x in runs):>12.2f}" for k in shown))
    # CPU seconds each process spent while the shards sampled (medians over rounds): on a machine whose
    # CPUs the inference server shares, what the flow's side spends there, the sampling waits for
    names = list(sampler.procs)
    print("CPU s while sampling:  " + "  ".join(f"{n:>10}" for n in names) + "      total")
    for name, runs in (("flow", stages), ("floor", floor)) if floor else (("flow", stages),):
        cpu = [sampler.cpu_between(*x["window"]) for x in runs]
        print(f"  {name:<20} " + "  ".join(f"{statistics.median(c.get(n, 0.0) for c in cpu):>10.2f}" for n in names)
              + f"  {statistics.median(sum(c.values()) for c in cpu):>9.2f}")
    print(f"whole flow {flow_wall:.1f} s (plus the final publish and hot-load); bodies timed in this process; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return {"rounds": len(rows), **{k: statistics.median(r[k] for r in rows) for k in rows[0]},
            "floor": statistics.median(x["wall"] for x in floor) if floor else float("nan"), "per_round": rows}


if __name__ == "__main__":
    main()
