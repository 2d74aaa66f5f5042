"""Benchmark: GRPO rounds per minute with a job per round, a resident trainer, and asynchronous rounds.

The same GRPO work (rounds, prompts, shards, completions, the tiny model, toy prompts, a folder
store, the reference inference server, a local training job) is run by the ``grpo`` flow as:

  per_round   (a) a step job per round (``trainer_job: per_round``): each loads torch, the policy
              and its optimizer again
  resident    (b) one resident trainer job, synchronous rounds (``max_staleness: 0``)
  async1      (c) resident, ``max_staleness: 1``: round r+1 samples while round r trains
  async2      (c) resident, ``max_staleness: 2``

Inference and training are pinned to one core each, as they would run on separate hardware: the
inference server (a ``posttrain serve`` process) and the Prefect server on core 0; the flow's
process and the training jobs it starts (they inherit its affinity) on core 1; one torch thread
each. Each mode runs once per seed (the trainer's seed), each run in a process of its own against
one Prefect server (SQLite) the benchmark starts on its own port and stops at the end.

It prints, per mode (medians over the seeds): rounds per minute of the flow run's wall time (from
the call to the flow's return: staging, submission, every round, the final publish and hot-load)
and its ratio to (a) measured in the same run; where the wall time went on each side (the
trainer: queue and start-up (interpreter, torch, model and optimizer loaded), updates, checkpoint
saves, waits for rounds; the flow: sampling, publish + hot-load, waits for the trainer); and the
mean reward per round over the seeds with the spread of the run means (min..max), so a user sees
whether asynchronous rounds learn as well on the toy task. No assertions.

    .venv/bin/python bench/grpo_throughput.py [--modes per_round,resident,async1,async2]
        [--seeds 0,1,2] [--rounds 6] [--shards 8] [--prompts-per-shard 2] [--num-generations 4]
        [--max-completion-length 8] [--port 4330] [--state-dir DIR]

About 15 minutes with the defaults on 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
for k, v in ENV.items():
    os.environ.setdefault(k, v)

MODES = {"per_round": ("per_round", 0), "resident": ("resident", 0), "async1": ("resident", 1),
         "async2": ("resident", 2)}
INFERENCE_CORE, TRAINING_CORE = 0, 1

from inference_server import pin, start_inference  # noqa: E402 - bench/, beside this file


def run_one(args: argparse.Namespace) -> dict:
    """One mode, one seed, in this process (pinned to the training core): the flow's wall time, its
    rounds table, and where the time went."""
    os.sched_setaffinity(0, {TRAINING_CORE} if TRAINING_CORE < (os.cpu_count() or 1) else {0})
    import torch

    torch.set_num_threads(1)
    import posttrain.pipeline.flows.grpo as grpo_module
    from posttrain.cluster import LocalConfig
    from posttrain.pipeline.blocks import LocalCluster
    from posttrain.pipeline.deployments.embedded import DEFAULT, save_default_blocks
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.pipeline.settings import GrpoSettings

    work = Path(args.work)
    base, dataset = work / "tiny-base", work / "prompts.jsonl"
    run_root = Path(tempfile.mkdtemp(prefix=f"{args.mode}-s{args.seed}-", dir=work))
    store = run_root / "store"
    token = secrets.token_urlsafe(16)
    server, url = start_inference(base, store, run_root, token, core=INFERENCE_CORE)
    trainer_job, k = MODES[args.mode]
    try:
        save_default_blocks(store_dir=store, server_url=url, deployment_id="dep-bench", model="tiny", token=token)
        LocalCluster(settings=LocalConfig(folder=str(run_root / "jobs"), poll_interval_s=0.2,
                                          env={k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
                     ).save(DEFAULT, overwrite=True)
        settings = GrpoSettings(
            run_name=f"bench-{args.mode.replace('_', '-')}-s{args.seed}", base_model=str(base), dataset=str(dataset),
            shared_dir=str(run_root / "shared"), rounds=args.rounds, shards=args.shards,
            prompts_per_round=args.shards * args.prompts_per_shard, trainer_job=trainer_job, max_staleness=k,
            watch_poll_s=0.2,
            rollout={"num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
                     "reward_funcs": ["posttrain.rewards:length_reward", "posttrain.rewards:format_reward"]},
            trainer={"learning_rate": 1e-3, "use_cpu": True, "seed": args.seed, "report_to": ["none"]},
        )
        t0 = time.perf_counter()
        report = grpo_module.grpo(**to_parameters(settings))
        wall = time.perf_counter() - t0
        return {"mode": args.mode, "seed": args.seed, "wall": wall, "rounds": report.rounds,
                "trainer": trainer_side(Path(report.run_dir), trainer_job), "flow": flow_side(report.rounds)}
    finally:
        server.terminate()
        server.wait(30)


def trainer_side(run_dir: Path, trainer_job: str) -> dict:
    """Seconds of the run's training jobs, from their timelines: queue and start-up (submission to the
    model loaded), updates, saves, waits for rounds (resident)."""
    from posttrain.runs.once import JobRecord, job_timeline

    markers = [run_dir / "training-job.json"] if trainer_job == "resident" else sorted(
        run_dir.glob("rounds/*/train-job.json"))
    out = {"jobs": len(markers), "start": 0.0, "update": 0.0, "save": 0.0, "wait": 0.0}
    for marker in markers:
        record = JobRecord.model_validate_json(marker.read_text())
        for a in job_timeline(record):
            if a.loaded is not None:
                out["start"] += a.loaded - min(a.start, record.submitted_at or a.start)
            out["update"] += sum(end - begin for _, begin, end in a.steps if end is not None)
            out["save"] += sum(end - begin for begin, end in a.saves)
            out["wait"] += sum(end - begin for begin, end in a.waits)
    return out


def flow_side(rounds: list[dict]) -> dict:
    """Seconds of the flow's rounds: sampling, publish + hot-load, waiting for the trainer (the resident's
    waits at the bound; a step job's whole run)."""
    sample = sum(r.get("sample s") or 0 for r in rounds)
    serve = sum((r.get("publish s") or 0) + (r.get("hot-load s") or 0) for r in rounds)
    waits = sum(r.get("wait s") or 0 for r in rounds)
    if all("wait s" not in r for r in rounds):  # per_round: the step job is what is left of the round
        waits = sum((r.get("round s") or 0) - (r.get("sample s") or 0) - (r.get("publish s") or 0)
                    - (r.get("hot-load s") or 0) for r in rounds)
    return {"sample": sample, "serve": serve, "wait": waits}


def prepare(work: Path, args: argparse.Namespace) -> None:
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.models.tiny import build_tiny_model

    build_tiny_model(work / "tiny-base", seed=0)
    write_toy_jsonl(work / "prompts.jsonl", n=max(64, args.rounds * args.shards * args.prompts_per_shard), seed=0,
                    task="mixed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="per_round,resident,async1,async2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--prompts-per-shard", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=8)
    ap.add_argument("--port", type=int, default=4330, help="the Prefect server's port")
    ap.add_argument("--state-dir", default=os.path.join(
        os.environ.get("POSTTRAIN_SERVICES_DIR", "/tmp/posttrain-services"), "bench-grpo"))
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # a child: one run
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--summary-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        Path(args.summary_json).write_text(json.dumps(run_one(args)))
        return
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODES)})")
    seeds = [int(s) for s in args.seeds.split(",")]
    state = Path(args.state_dir)
    env = {**os.environ, "POSTTRAIN_SERVICES_DIR": str(state), "PREFECT_UI": "0", "POSTTRAIN_PREFECT_DB": "sqlite",
           "PREFECT_PORT": str(args.port), "POSTTRAIN_PREFECT_DIR": str(state / "prefect"),
           "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent)}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    scripts = ROOT / "scripts/services"
    work = Path(tempfile.mkdtemp(prefix="posttrain-grpo-bench-"))
    results: list[dict] = []
    load0 = os.getloadavg()[0]
    subprocess.run(["bash", str(scripts / "start-prefect.sh")], env=env, check=True, preexec_fn=pin(INFERENCE_CORE))
    try:
        prepare(work, args)
        for seed in seeds:  # seeds outermost: a drift of the machine's speed spreads over every mode
            for mode in modes:
                out = work / f"summary-{mode}-{seed}.json"
                child = [sys.executable, __file__, "--mode", mode, "--seed", str(seed), "--work", str(work),
                         "--summary-json", str(out), "--rounds", str(args.rounds), "--shards", str(args.shards),
                         "--prompts-per-shard", str(args.prompts_per_shard), "--num-generations",
                         str(args.num_generations), "--max-completion-length", str(args.max_completion_length)]
                print(f"running {mode}, seed {seed} ...", flush=True)
                rc = subprocess.run(child, env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{args.port}/api"}).returncode
                if rc == 0 and out.exists():
                    results.append(json.loads(out.read_text()))
                    print(f"  {results[-1]['wall']:.1f} s", flush=True)
                else:
                    print(f"  failed (exit {rc})", flush=True)
    finally:
        subprocess.run(["bash", str(scripts / "stop-prefect.sh")], env=env, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    report(results, modes, args, (load0, os.getloadavg()[0]))


def report(results: list[dict], modes: list[str], args: argparse.Namespace, load: tuple[float, float]) -> None:
    by_mode = {m: [r for r in results if r["mode"] == m] for m in modes}
    rpm = {m: statistics.median(args.rounds / r["wall"] * 60 for r in rs) for m, rs in by_mode.items() if rs}
    base = rpm.get("per_round")
    print(f"\nGRPO, {args.rounds} rounds x {args.shards} shards x {args.prompts_per_shard} prompts x "
          f"{args.num_generations} completions (<= {args.max_completion_length} tokens); inference on core "
          f"{INFERENCE_CORE}, flow + training on core {TRAINING_CORE}; medians over seeds "
          f"{args.seeds}; seconds per run; {os.cpu_count()} CPUs, load (1 min) {load[0]:.2f} before, "
          f"{load[1]:.2f} after")
    header = (f"{'mode':>10} {'runs':>4} {'rounds/min':>10} {'vs (a)':>7} {'wall s':>7} | {'trainer: start':>14} "
              f"{'update':>6} {'save':>5} {'waits':>6} | {'flow: sample':>12} {'pub+load':>8} {'waits':>6} | "
              f"{'staleness':>9} | {'mean reward/round':>17} {'spread of run means':>19}")
    print(header)
    print("-" * len(header))
    for mode, rs in by_mode.items():
        if not rs:
            print(f"{mode:>10}    0  failed")
            continue
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        run_means = [statistics.fmean(x["reward mean"] for x in r["rounds"]) for r in rs]
        stale = statistics.fmean(x.get("staleness", 0) for r in rs for x in r["rounds"])
        ratio = f"{rpm[mode] / base:.2f}x" if base else "-"
        print(f"{mode:>10} {len(rs):>4} {rpm[mode]:>10.2f} {ratio:>7} {med(lambda r: r['wall']):>7.1f} | "
              f"{med(lambda r: r['trainer']['start']):>14.1f} {med(lambda r: r['trainer']['update']):>6.1f} "
              f"{med(lambda r: r['trainer']['save']):>5.1f} {med(lambda r: r['trainer']['wait']):>6.1f} | "
              f"{med(lambda r: r['flow']['sample']):>12.1f} {med(lambda r: r['flow']['serve']):>8.1f} "
              f"{med(lambda r: r['flow']['wait']):>6.1f} | {stale:>9.2f} | {statistics.fmean(run_means):>17.3f} "
              f"{min(run_means):>9.3f}..{max(run_means):<8.3f}")
    print("\nmean reward per round, mean over seeds:")
    for mode, rs in by_mode.items():
        if rs:
            per_round = [statistics.fmean(r["rounds"][i]["reward mean"] for r in rs) for i in range(args.rounds)]
            print(f"{mode:>10}: " + " ".join(f"{x:.3f}" for x in per_round))


if __name__ == "__main__":
    main()
