"""``posttrain demo``: the main job on the embedded defaults, on this machine.

A tiny model and a toy prompt set are built locally; training runs as a local process; snapshots
go to a folder store; the reference inference server hot-loads them and serves the rollouts.
It runs a nightly pass (train → publish → hot-load every checkpoint), then GRPO rounds.
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job end to end on the embedded defaults")
    p.add_argument("--workdir", type=Path, default=Path("runs") / "demo", help="where everything is written")
    p.add_argument("--steps", type=int, default=4, help="training steps of the nightly pass")
    p.add_argument("--rounds", type=int, default=2, help="GRPO rounds")
    p.set_defaults(func=cmd_demo)


PRODUCTION = "posttrain-inference-deployment/production"
REWARDS = ["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"]
# The eval gate of the demo: 16 held-out prompts, 2 samples each, the runs' rewards.
GATE = {"eval_samples_per_prompt": 2, "eval_max_tokens": 8}


def demo_settings(work: Path, base_model: Path, dataset: Path, *, steps: int, rounds: int, eval_dataset: Path):
    from posttrain.pipeline.settings import GrpoSettings, NightlySettings

    rewards = REWARDS
    nightly = NightlySettings(
        run_name="demo-nightly", base_model=str(base_model), dataset=str(dataset), shared_dir=str(work / "shared"),
        trainer={"reward_funcs": rewards, "learning_rate": 1e-3, "per_device_train_batch_size": 8,
                 "num_generations": 4, "max_completion_length": 8, "max_steps": steps, "save_steps": 1,
                 "use_cpu": True},
        watch_poll_s=0.5, promote_to=PRODUCTION, promotion={"eval_dataset": str(eval_dataset), **GATE},
    )
    grpo = GrpoSettings(
        run_name="demo-grpo", base_model=str(base_model), dataset=str(dataset), shared_dir=str(work / "shared"),
        rounds=rounds, prompts_per_round=8, shards=2,
        rollout={"num_generations": 4, "max_completion_length": 8, "reward_funcs": rewards},
        trainer={"learning_rate": 1e-3, "use_cpu": True},
    )
    return nightly, grpo


def cmd_demo(args: argparse.Namespace) -> int:
    import shutil

    from rich.table import Table

    from posttrain.cli.chain import make_console
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.models.tiny import build_tiny_model
    from posttrain.pipeline.deployments.embedded import DEFAULT, save_default_blocks
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    console = make_console()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    console.print(f"[bold]posttrain demo[/] in {work}")
    base = build_tiny_model(work / "models" / "tiny-base", seed=0)
    dataset = write_toy_jsonl(work / "data" / "prompts.jsonl", n=32, seed=0, task="mixed")
    eval_dataset = write_toy_jsonl(work / "data" / "eval.jsonl", n=16, seed=1, task="mixed")  # held out
    store = work / "store"
    token = secrets.token_urlsafe(24)
    servers = [InferenceServer(ServeConfig(model_dir=base, served_model_name="tiny", port=0, deployment_id=name,
                                           store=str(store), token=token, work_dir=work / name, device="cpu"))
               for name in ("posttrain-demo", "posttrain-demo-production")]
    server, production = servers
    for s in servers:
        s.start()
    try:
        console.print(f"reference inference servers: staging {server.url} (deployment posttrain-demo), production "
                      f"{production.url} (posttrain-demo-production)")
        save_default_blocks(store_dir=store, server_url=server.url, deployment_id="posttrain-demo", model="tiny",
                            token=token)
        _save_production(production.url, token)
        nightly_settings, grpo_settings = demo_settings(work, base, dataset, steps=args.steps, rounds=args.rounds,
                                                        eval_dataset=eval_dataset)

        from posttrain.pipeline.flows.grpo import grpo
        from posttrain.pipeline.flows.nightly import nightly_post_training
        from posttrain.pipeline.parameters import to_parameters

        nightly = nightly_post_training(**to_parameters(nightly_settings))
        table = Table(title="nightly pass: every checkpoint published and hot-loaded")
        for col in nightly.snapshots[0] if nightly.snapshots else []:
            table.add_column(col)
        for row in nightly.snapshots:
            table.add_row(*(str(v) for v in row.values()))
        console.print(table)
        gate = nightly.promotion
        console.print(f"promotion to production: {'promoted' if gate['promoted'] else 'refused'} "
                      f"{gate['candidate']}: {gate['reason']}")

        report = grpo(**to_parameters(grpo_settings))
        table = Table(title="GRPO rounds")
        for col in report.rounds[0]:
            table.add_column(col)
        for row in report.rounds:
            table.add_row(*(str(v) for v in row.values()))
        console.print(table)
        gate = _promote(work, base, eval_dataset, report.final_snapshot)
        console.print(f"promotion to production: {'promoted' if gate.promoted else 'refused'} {gate.candidate}: "
                      f"{gate.reason}")
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
    console.print(f"staging serves {report.final_snapshot}; production serves "
                  f"{gate.candidate if gate.promoted else gate.champion}; final policy at {report.final_checkpoint}")
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


def _save_production(url: str, token: str) -> None:
    from posttrain.pipeline.blocks import InferenceDeployment

    InferenceDeployment(api_url=url, gateway_url=url, deployment_id="posttrain-demo-production", model="tiny",
                        token=token, timeout_s=300, poll_interval_s=0.2).save(PRODUCTION.split("/")[1], overwrite=True)


def _promote(work: Path, base: Path, eval_dataset: Path, candidate: str):
    """GRPO's last snapshot through the eval gate, against what the nightly pass promoted."""
    from posttrain.pipeline.flows.promote import promote
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.pipeline.promotion_settings import PromoteSettings

    settings = PromoteSettings(production=PRODUCTION, candidate=candidate, tokenizer=str(base),
                               shared_dir=str(work / "shared"),
                               promotion={"eval_dataset": str(eval_dataset), "eval_reward_funcs": REWARDS, **GATE})
    return promote(**to_parameters(settings))
