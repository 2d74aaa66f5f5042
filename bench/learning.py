"""Benchmark: does the loop make a real model better, per mode, against TRL's GRPOTrainer alone?

The same GRPO work on SmolLM2-135M-Instruct (``posttrain models prepare``) and the arithmetic task
(``posttrain.tasks``: its reward is exact-match plus format, weighted 0.75 / 0.25 so it lies in [0, 1]):
``--prompts`` prompts a round, ``--num-generations`` completions each of at most
``--max-completion-length`` tokens, the same learning rate (constant), loss type (dapo) and seed, run as

  per_round   the ``grpo`` flow, a step job per round (``trainer_job: per_round``)
  resident    the ``grpo`` flow, one resident trainer, synchronous rounds (``max_staleness: 0``)
  async1      resident, ``max_staleness: 1``: round r+1 samples while round r trains
  async2      resident, ``max_staleness: 2``
  trl         TRL's GRPOTrainer alone, one process that samples with transformers' ``generate`` and
              trains (what a user would run instead): one optimizer step per round

The flow's modes run against a Prefect server (SQLite) the benchmark starts, the reference inference
server and a folder store; each run is a process of its own. For every run it records the mean reward
of each round (or step) with its wall time from the run's start, and the held-out accuracy
(``posttrain.cli.demo.greedy_accuracy``: greedy, ``--eval-prompts`` problems of the eval split, the
answer's number exact) of the base and of the final policy. It prints per mode: mean reward of the first and last 10 rounds and the gain, the final reward,
wall time, and the held-out accuracy before and after, each as the mean over seeds with the min..max
spread; then the reward curves; and writes bench/.data/learning/results.json (and, with matplotlib, the
plots docs/learning/*.png). No assertions.

    .venv/bin/python bench/learning.py [--modes per_round,resident,async1,async2,trl] [--seeds 0,1,2]
        [--rounds 30] [--prompts 4] [--num-generations 4] [--max-completion-length 32]
        [--learning-rate 2e-5] [--save-dtype auto|float32] [--eval-prompts 64] [--port 4331]

On 2 CPUs a round takes 10-25 s: the defaults (5 modes x 3 seeds x 30 rounds) run for about 3 hours.
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
       "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
for k, v in ENV.items():
    os.environ.setdefault(k, v)

FLOW_MODES = {"per_round": ("per_round", 0), "resident": ("resident", 0), "async1": ("resident", 1),
              "async2": ("resident", 2)}
MODES = [*FLOW_MODES, "trl"]
WEIGHTS = [0.75, 0.25]  # arithmetic_correct, arithmetic_format: a reward in [0, 1]
DATA = ROOT / "bench" / ".data" / "learning"


def trainer_settings(args: argparse.Namespace) -> dict:
    return {"learning_rate": args.learning_rate, "loss_type": "dapo", "seed": args.seed, "use_cpu": True,
            "report_to": ["none"], "save_dtype": args.save_dtype}


def run_flow(args: argparse.Namespace, base: Path, dataset: Path, run_root: Path) -> tuple[list[dict], Path]:
    """One of the flow's modes: the rounds (reward, seconds from the start) and the final checkpoint."""
    from inference_server import start_inference

    import posttrain.pipeline.flows.grpo as grpo_module
    from posttrain.pipeline.deployments.embedded import save_default_blocks
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.pipeline.settings import GrpoSettings
    from posttrain.tasks import get_task

    task = get_task("arithmetic")
    token = secrets.token_urlsafe(16)
    server, url = start_inference(base, run_root / "store", run_root, token, core=None)
    trainer_job, k = FLOW_MODES[args.mode]
    try:
        save_default_blocks(store_dir=run_root / "store", server_url=url, deployment_id="dep-bench", model="tiny",
                            token=token)
        settings = GrpoSettings(
            run_name=f"learning-{args.mode.replace('_', '-')}-s{args.seed}", base_model=str(base), dataset=str(dataset),
            shared_dir=str(run_root / "shared"), rounds=args.rounds, shards=2, prompts_per_round=args.prompts,
            trainer_job=trainer_job, max_staleness=k, watch_poll_s=0.2,
            rollout={"num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
                     "reward_funcs": list(task.reward_funcs), "reward_weights": WEIGHTS},
            trainer=trainer_settings(args))
        t0 = time.perf_counter()
        report = grpo_module.grpo(**to_parameters(settings))
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(30)
    elapsed, rows = 0.0, []
    for row in report.rounds:  # a round's own seconds, summed: the curve against wall time
        elapsed += row.get("round s") or 0.0
        rows.append({"round": row["round"], "reward": row["reward mean"], "seconds": elapsed})
    rows[-1]["seconds"] = wall
    return rows, Path(report.final_checkpoint)


def run_trl(args: argparse.Namespace, base: Path, dataset: Path, run_root: Path) -> tuple[list[dict], Path]:
    """TRL's GRPOTrainer alone on the same prompts: one optimizer step per round."""
    from posttrain.datasets.staging import stage_dataset
    from posttrain.tasks import get_task
    from posttrain.trainer import TrainerConfig, run_training
    from posttrain.trainer.checkpoints import last_complete_checkpoint

    task = get_task("arithmetic")
    staged = stage_dataset(dataset, run_root / "staged")
    config = TrainerConfig(
        mode="grpo", model_name_or_path=str(base), output_dir=str(run_root / "trl"),
        dataset_manifest=str(staged.manifest_path), reward_funcs=list(task.reward_funcs), reward_weights=WEIGHTS,
        per_device_train_batch_size=args.prompts * args.num_generations, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, max_steps=args.rounds, save_steps=args.rounds,
        lr_scheduler_type="constant", logging_steps=1, **trainer_settings(args))
    t0 = time.perf_counter()
    run_training(config)
    wall = time.perf_counter() - t0
    last = last_complete_checkpoint(run_root / "trl")
    history = json.loads((last.path / "trainer_state.json").read_text())["log_history"]
    steps = [e for e in history if "reward" in e and "step" in e]
    spent = sum(e.get("step_time", 0.0) for e in steps) or 1.0
    rows, elapsed = [], 0.0
    for e in steps:  # TRL's step times, scaled to the run's wall (its start-up spread over the steps)
        elapsed += e.get("step_time", 0.0) * wall / spent
        rows.append({"round": e["step"] - 1, "reward": e["reward"], "seconds": elapsed})
    return rows, last.path


def run_one(args: argparse.Namespace) -> dict:
    from posttrain.cli.demo import greedy_accuracy
    from posttrain.tasks import get_task

    work = Path(args.work)
    base, dataset = Path(args.base), work / "train.jsonl"
    run_root = Path(tempfile.mkdtemp(prefix=f"{args.mode}-s{args.seed}-", dir=work))
    rows, final = (run_trl if args.mode == "trl" else run_flow)(args, base, dataset, run_root)
    eval_rows = get_task("arithmetic").rows("eval", args.eval_prompts, seed=0)
    after = greedy_accuracy(final, eval_rows, args.max_completion_length)
    # a round's checkpoint of the real model is ~1.9 GB (weights, float32 masters, optimizer): 30 rounds
    # filled this machine's disk before the run's folder was dropped once measured
    shutil.rmtree(run_root, ignore_errors=True)
    return {"mode": args.mode, "seed": args.seed, "rounds": rows,
            "accuracy_before": json.loads((work / "base-accuracy.json").read_text())["accuracy"],
            "accuracy_after": after}


def summary(rs: list[dict], key) -> str:
    values = [key(r) for r in rs]
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def report(results: list[dict], modes: list[str], args: argparse.Namespace) -> None:
    window = min(10, max(1, args.rounds // 3))
    first = lambda r: statistics.fmean(x["reward"] for x in r["rounds"][:window])  # noqa: E731
    last = lambda r: statistics.fmean(x["reward"] for x in r["rounds"][-window:])  # noqa: E731
    print(f"\nGRPO on SmolLM2-135M-Instruct, arithmetic: {args.rounds} rounds x {args.prompts} prompts x "
          f"{args.num_generations} completions (<= {args.max_completion_length} tokens), lr {args.learning_rate:g}, "
          f"dapo; seeds {args.seeds}; mean (min..max) over seeds; {os.cpu_count()} CPUs")
    header = (f"{'mode':>10} | {f'first {window} rounds':>20} | {f'last {window} rounds':>20} | {'gain':>20} | "
              f"{'wall s':>22} | {'held-out before':>15} | {'held-out after':>20}")
    print(header)
    print("-" * len(header))
    for mode in modes:
        rs = [r for r in results if r["mode"] == mode]
        if not rs:
            print(f"{mode:>10} | failed")
            continue
        print(f"{mode:>10} | {summary(rs, first):>20} | {summary(rs, last):>20} | "
              f"{summary(rs, lambda r: last(r) - first(r)):>20} | "
              f"{summary(rs, lambda r: r['rounds'][-1]['seconds']):>22} | {rs[0]['accuracy_before']:>15.3f} | "
              f"{summary(rs, lambda r: r['accuracy_after']):>20}")
    print("\nmean reward per round, mean over seeds:")
    for mode in modes:
        rs = [r for r in results if r["mode"] == mode]
        if rs:
            n = min(len(r["rounds"]) for r in rs)
            print(f"{mode:>10}: " + " ".join(f"{statistics.fmean(r['rounds'][i]['reward'] for r in rs):.2f}"
                                             for i in range(n)))
    plot(results, modes)


def plot(results: list[dict], modes: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    out = ROOT / "docs" / "learning"
    out.mkdir(parents=True, exist_ok=True)
    for x_key, name in (("round", "reward-by-round"), ("seconds", "reward-by-wall-time")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for mode in modes:
            for i, r in enumerate(x for x in results if x["mode"] == mode):
                ax.plot([p[x_key] for p in r["rounds"]], [p["reward"] for p in r["rounds"]], alpha=0.8,
                        color=f"C{modes.index(mode)}", label=mode if i == 0 else None)
        ax.set_xlabel("round" if x_key == "round" else "wall time (s)")
        ax.set_ylabel("mean reward")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=32)
    ap.add_argument("--learning-rate", type=float, default=2e-5)
    ap.add_argument("--save-dtype", choices=["auto", "float32"], default="auto",
                    help="the checkpoints' dtype (auto: the base's, bfloat16): what the flow's rounds sample from")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--port", type=int, default=4331, help="the Prefect server's port")
    for hidden in ("--mode", "--seed", "--work", "--base", "--summary-json"):
        ap.add_argument(hidden, help=argparse.SUPPRESS, type=int if hidden == "--seed" else str)
    args = ap.parse_args()
    if args.mode:
        Path(args.summary_json).write_text(json.dumps(run_one(args)))
        return
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODES)})")
    from posttrain.cli.demo import greedy_accuracy
    from posttrain.models.catalog import SMOLLM2_135M_INSTRUCT
    from posttrain.models.prepare import prepare_model
    from posttrain.tasks import get_task

    base = prepare_model(SMOLLM2_135M_INSTRUCT).path
    work = Path(tempfile.mkdtemp(prefix="posttrain-learning-"))
    get_task("arithmetic").write_jsonl(work / "train.jsonl", "train", 1024, seed=0)
    before = greedy_accuracy(base, get_task("arithmetic").rows("eval", args.eval_prompts, seed=0),
                              args.max_completion_length)
    (work / "base-accuracy.json").write_text(json.dumps({"accuracy": before}))
    state = Path(os.environ.get("POSTTRAIN_SERVICES_DIR", "/tmp/posttrain-services")) / "bench-learning"
    env = {**os.environ, "POSTTRAIN_SERVICES_DIR": str(state), "PREFECT_UI": "0", "POSTTRAIN_PREFECT_DB": "sqlite",
           "PREFECT_PORT": str(args.port), "POSTTRAIN_PREFECT_DIR": str(state / "prefect"),
           "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent)}
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    scripts = ROOT / "scripts" / "services"
    results: list[dict] = []
    subprocess.run(["bash", str(scripts / "start-prefect.sh")], env=env, check=True)
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for mode in modes:
                out = work / f"summary-{mode}-{seed}.json"
                child = [sys.executable, __file__, "--mode", mode, "--seed", str(seed), "--work", str(work),
                         "--base", str(base), "--summary-json", str(out), "--rounds", str(args.rounds),
                         "--prompts", str(args.prompts), "--num-generations", str(args.num_generations),
                         "--max-completion-length", str(args.max_completion_length),
                         "--learning-rate", str(args.learning_rate), "--eval-prompts", str(args.eval_prompts),
                         "--save-dtype", args.save_dtype]
                print(f"running {mode}, seed {seed} ...", flush=True)
                rc = subprocess.run(child, env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{args.port}/api"}).returncode
                if rc == 0 and out.exists():
                    results.append(json.loads(out.read_text()))
                    print(f"  {results[-1]['rounds'][-1]['seconds']:.0f} s, reward {results[-1]['rounds'][0]['reward']:.3f}"
                          f" -> {results[-1]['rounds'][-1]['reward']:.3f}", flush=True)
                else:
                    print(f"  failed (exit {rc})", flush=True)
    finally:
        subprocess.run(["bash", str(scripts / "stop-prefect.sh")], env=env, capture_output=True)
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "results.json").write_text(json.dumps({"args": vars(args), "base_accuracy": before, "runs": results},
                                                  indent=1))
    report(results, modes, args)


if __name__ == "__main__":
    main()
