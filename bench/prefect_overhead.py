"""Benchmark: Prefect's orchestration overhead per GRPO round (rollout shards as mapped subflows).

Runs the ``grpo`` flow in this process against a Prefect server, with the tiny model, toy prompts,
a folder store, the in-process reference inference server and a local training process. Every
task body of a round is timed by wrapping the task's function (publish-checkpoint, hot-load, the
8 ``rollout-shard`` tasks, the ``sample-and-score`` task inside each shard's subflow, train-step).
Per round it prints:

  wall       the round as the flow timed it ("round s" of its table: publish to training step)
  bodies     time during which at least one task body ran (union of the body intervals)
  overhead   wall - bodies: time in which only Prefect ran (creating runs, states, subflows, results)
  per run    overhead / Prefect runs of the round (tasks + subflows)
  sample     sum and union of the sample-and-score bodies (they share one inference server)
  subflow    mean of (rollout-shard task body - its sample-and-score body): one subflow's cost
  503s       API answers "retry later" (SQLite busy) that the client backed off on

No assertions. The server is $PREFECT_API_URL, else one started like scripts/test.sh does (port
4300, or --port) and stopped at the end.

    .venv/bin/python bench/prefect_overhead.py [--shards 8] [--rounds 3] [--prompts-per-shard 2]
"""

from __future__ import annotations

import argparse
import inspect
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
import urllib.request
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


def healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=3) as r:
            return b"true" in r.read()
    except OSError:
        return False


def ensure_server(port: int) -> dict | None:
    """PREFECT_API_URL, or a server on ``port`` (started here when none answers: its env is returned)."""
    if os.environ.get("PREFECT_API_URL"):
        if not healthy(os.environ["PREFECT_API_URL"].rstrip("/")):
            raise SystemExit(f"PREFECT_API_URL={os.environ['PREFECT_API_URL']} does not answer")
        return None
    api = f"http://127.0.0.1:{port}/api"
    os.environ["PREFECT_API_URL"] = api
    if healthy(api):
        return None
    env = {**os.environ, "PREFECT_PORT": str(port), "PREFECT_UI": "0",
           "POSTTRAIN_PREFECT_DIR": os.environ.get("POSTTRAIN_PREFECT_DIR", "/tmp/posttrain-services/prefect-tests"),
           "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent)}
    subprocess.run(["bash", str(ROOT / "scripts/services/start-prefect.sh")], env=env, check=True)
    return env


def timed(task_obj, label: str, round_of, shard_of=None) -> None:
    """Wrap the task's function so every call records its body interval."""
    inner = task_obj.fn
    sig = inspect.signature(getattr(inner, "fn", inner))  # a task around a subflow wraps the Flow

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
    task_obj.fn = wrapper


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
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-shard", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=8)
    ap.add_argument("--port", type=int, default=int(os.environ.get("POSTTRAIN_TEST_PREFECT_PORT", "4300")))
    args = ap.parse_args()

    started = ensure_server(args.port)
    try:
        run(args)
    finally:
        if started is not None:
            subprocess.run(["bash", str(ROOT / "scripts/services/stop-prefect.sh")], env=started,
                           capture_output=True)


def run(args: argparse.Namespace) -> None:
    import posttrain.pipeline.flows.grpo as grpo_module
    from posttrain.cluster import LocalConfig
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.models.tiny import build_tiny_model
    from posttrain.pipeline.blocks import LocalCluster
    from posttrain.pipeline.deployments.embedded import DEFAULT, save_default_blocks
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.pipeline.settings import GrpoSettings
    from posttrain.pipeline.tasks import publishing, rollouts, training
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    client_log = logging.getLogger("prefect.client")
    client_log.setLevel(logging.DEBUG)
    client_log.addFilter(Count503())

    timed(publishing.publish_checkpoint, "publish", lambda a: a["step"])
    timed(publishing.hot_load, "hot-load", lambda a: a["snapshot"].step)
    timed(rollouts.rollout_shard_task, "shard-task", lambda a: a["spec"].round, lambda a: a["spec"].shard)
    timed(rollouts.sample_and_score, "sample", lambda a: a["spec"].round, lambda a: a["spec"].shard)
    timed(training.train_step, "train", lambda a: a["round"])

    work = Path(tempfile.mkdtemp(prefix="posttrain-prefect-bench-"))
    base = build_tiny_model(work / "tiny-base", seed=0)
    prompts = args.shards * args.prompts_per_shard
    dataset = write_toy_jsonl(work / "prompts.jsonl", n=max(prompts, 16), seed=0, task="mixed")
    store = work / "store"
    token = secrets.token_urlsafe(16)
    server = InferenceServer(ServeConfig(model_dir=base, served_model_name="tiny", port=0,
                                         deployment_id="dep-bench", store=str(store), token=token,
                                         work_dir=work / "inference", device="cpu")).start()
    try:
        save_default_blocks(store_dir=store, server_url=server.url, deployment_id="dep-bench", model="tiny",
                            token=token)
        LocalCluster(settings=LocalConfig(folder=str(work / "jobs"))).save(DEFAULT, overwrite=True)
        settings = GrpoSettings(
            run_name=f"bench-{int(time.time())}", base_model=str(base), dataset=str(dataset),
            shared_dir=str(work / "shared"), rounds=args.rounds, prompts_per_round=prompts, shards=args.shards,
            rollout={"num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
                     "reward_funcs": ["posttrain.rewards:correctness_reward"]},
            trainer={"learning_rate": 1e-3, "use_cpu": True},
        )
        t0 = time.perf_counter()
        report = grpo_module.grpo(**to_parameters(settings))
        flow_wall = time.perf_counter() - t0
    finally:
        server.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    runs_per_round = 1 + 1 + 3 * args.shards + 1  # publish, hot-load, per shard (task, subflow, sample), train
    header = (f"{'round':>5} {'wall s':>7} {'bodies s':>8} {'overhead s':>10} {'overhead %':>10} "
              f"{'runs':>4} {'per run ms':>10} {'per shard ms':>12} {'sample sum s':>12} {'sample union s':>14} "
              f"{'subflow ms':>10} {'503s':>4}")
    print()
    print(f"GRPO, {args.shards} shards x {args.prompts_per_shard} prompts x {args.num_generations} completions, "
          f"{args.rounds} rounds, Prefect API {os.environ['PREFECT_API_URL']}")
    print(header)
    print("-" * len(header))
    for row in report.rounds:
        r = row["round"]
        bodies = [b for b in BODIES if b[1] == r]
        outer = [(s, e) for label, _, s, e, _ in bodies if label != "shard-task"]  # shard tasks hold subflows
        samples = [b for b in bodies if b[0] == "sample"]
        shard_tasks = {b[4]: b for b in bodies if b[0] == "shard-task"}
        window = (min(s for s, _ in outer), max(e for _, e in outer))
        retries = sum(window[0] <= t <= window[1] for t in RETRIES_503)
        wall = row["round s"]
        busy = union(outer)
        overhead = wall - busy
        subflow = [(shard_tasks[b[4]][3] - shard_tasks[b[4]][2]) - (b[3] - b[2])
                   for b in samples if b[4] in shard_tasks]
        print(f"{r:>5} {wall:>7.2f} {busy:>8.2f} {overhead:>10.2f} {100 * overhead / wall:>10.1f} "
              f"{runs_per_round:>4} {1000 * overhead / runs_per_round:>10.0f} {1000 * overhead / args.shards:>12.0f} "
              f"{sum(e - s for _, _, s, e, _ in samples):>12.2f} {union([(s, e) for _, _, s, e, _ in samples]):>14.2f} "
              f"{1000 * statistics.fmean(subflow) if subflow else float('nan'):>10.0f} {retries:>4}")
    print(f"whole flow {flow_wall:.1f} s (plus the final publish and hot-load); bodies timed in this process")


if __name__ == "__main__":
    main()
