"""Stand-in jobs that exercise a backend end to end: count steps, checkpoint after each one,
resume from the checkpoint after a requeue; or check the launcher's rendezvous with one
all-reduce over every process. Useful to try a new cluster before a real run:

    python -m posttrain.cluster.smoke --steps 20 --sleep 1 --state /shared/smoke/state.json
    python -m posttrain.cluster.smoke --all-reduce     # under torchrun/accelerate (NCCL on GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import submitit

from posttrain.fsutil import atomic_write


def _read(state: Path) -> int:
    try:
        return int(json.loads(state.read_text())["step"])
    except FileNotFoundError:
        return 0


def _write(state: Path, step: int) -> None:
    atomic_write(state, json.dumps({"step": step}))


def count(steps: int, state_file: str, sleep_s: float = 0.5) -> dict:
    """Count to ``steps``, writing the step to ``state_file`` after each one; a restart resumes
    from the file. Every start is appended to ``<state_file>.starts`` (step it resumed from)."""
    state = Path(state_file)
    state.parent.mkdir(parents=True, exist_ok=True)
    step = _read(state)
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    with open(f"{state_file}.starts", "a") as f:
        f.write(json.dumps({"resumed_from": step, "slurm_restart_count": restarts}) + "\n")
    print(f"counting from step {step} to {steps}", flush=True)
    while step < steps:
        time.sleep(sleep_s)
        step += 1
        _write(state, step)
        print(f"step {step}", flush=True)
    return {"step": step, "env_probe": os.environ.get("SMOKE_PROBE")}


class CountingJob(submitit.helpers.Checkpointable):
    """Checkpointable stand-in: submitit requeues it on timeout/preemption, and it resumes from
    its state file whether or not its checkpoint() ran."""

    def __call__(self, steps: int, state_file: str, sleep_s: float = 0.5) -> dict:
        return count(steps, state_file, sleep_s)


def all_reduce() -> int:
    """One all-reduce of the ranks over every process of the launcher; prints the world."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank)], device="cuda" if cuda else "cpu")
    dist.all_reduce(value)
    expected = world * (world - 1) / 2
    print(f"rank {rank} of {world} on {os.uname().nodename}: all-reduce sum {value.item():g} "
          f"(expected {expected:g}, backend {dist.get_backend()})", flush=True)
    dist.destroy_process_group()
    return 0 if value.item() == expected else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-reduce", action="store_true", help="check the launcher's rendezvous instead")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--state", help="checkpoint file (on shared storage)")
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds per step")
    parser.add_argument("--fail-at", type=int, default=None, help="exit with status 3 at this step")
    args = parser.parse_args(argv)
    if args.all_reduce:
        return all_reduce()
    if not args.state:
        parser.error("--state is required unless --all-reduce")
    if args.fail_at is not None and _read(Path(args.state)) < args.fail_at:
        count(args.fail_at, args.state, args.sleep)
        print(f"failing at step {args.fail_at} as asked", flush=True)
        return 3
    count(args.steps, args.state, args.sleep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
