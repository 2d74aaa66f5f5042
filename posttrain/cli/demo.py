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


def demo_settings(work: Path, base_model: Path, dataset: Path, *, steps: int, rounds: int):
    from posttrain.pipeline.settings import GrpoSettings, NightlySettings

    rewards = ["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"]
    nightly = NightlySettings(
        run_name="demo-nightly", base_model=str(base_model), dataset=str(dataset), shared_dir=str(work / "shared"),
        trainer={"reward_funcs": rewards, "learning_rate": 1e-3, "per_device_train_batch_size": 8,
                 "num_generations": 4, "max_completion_length": 8, "max_steps": steps, "save_steps": 1,
                 "use_cpu": True},
        watch_poll_s=0.5,
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
    from posttrain.pipeline.deployments.embedded import save_default_blocks
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    console = make_console()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    console.print(f"[bold]posttrain demo[/] in {work}")
    base = build_tiny_model(work / "models" / "tiny-base", seed=0)
    dataset = write_toy_jsonl(work / "data" / "prompts.jsonl", n=32, seed=0, task="mixed")
    store = work / "store"
    token = secrets.token_urlsafe(24)
    server = InferenceServer(ServeConfig(model_dir=base, served_model_name="tiny", port=0,
                                         deployment_id="posttrain-demo", store=str(store), token=token,
                                         work_dir=work / "inference", device="cpu"))
    server.start()
    try:
        console.print(f"reference inference server on {server.url} (deployment posttrain-demo)")
        save_default_blocks(store_dir=store, server_url=server.url, deployment_id="posttrain-demo", model="tiny",
                            token=token)
        nightly_settings, grpo_settings = demo_settings(work, base, dataset, steps=args.steps, rounds=args.rounds)

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

        report = grpo(**to_parameters(grpo_settings))
        table = Table(title="GRPO rounds")
        for col in report.rounds[0]:
            table.add_column(col)
        for row in report.rounds:
            table.add_row(*(str(v) for v in row.values()))
        console.print(table)
    finally:
        server.shutdown()
    console.print(f"the deployment serves {report.final_snapshot}; final policy at {report.final_checkpoint}")
    console.print("[bold]where to look[/]:")
    console.print(f"  run folders      {work / 'shared' / 'runs'}")
    console.print(f"  snapshot chain   {store}  (posttrain chain inspect {store})")
    console.print(f"  reward curve     {report.reward_curve}")
    import os

    api = os.environ.get("PREFECT_API_URL")
    if api:
        console.print(f"  Prefect UI       {api.removesuffix('/api')}  (flow runs, artifacts: tables, progress, "
                      "reward curve)")
    return 0
