"""Data parallelism across processes and nodes, from the launcher's environment (torchrun sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): the same settings run
on CPU (gloo) and GPU (nccl). Rank 0 alone writes checkpoints and results; the others only read.

``mode: grpo`` leaves the process group to accelerate (inside TRL's trainer); ``mode: step`` and
``mode: resident`` set it up here (:func:`init`) and sums gradients itself (:func:`all_reduce_sum`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def ranks() -> Ranks:
    """This process's place, from the launcher's variables (one process of one: no launcher)."""
    env = os.environ
    return Ranks(
        rank=int(env.get("RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", env.get("SLURM_NODEID", "0")))),
    )


def is_main() -> bool:
    return ranks().is_main


def backend(use_cpu: bool) -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and not use_cpu else "gloo"


def describe(r: Ranks, backend_name: str) -> str:
    node = os.environ.get("SLURMD_NODENAME")
    where = socket.gethostname() + (f" (Slurm node {node})" if node else "")
    return (f"distributed: rank {r.rank} of world size {r.world_size} (node rank {r.node_rank}, local rank "
            f"{r.local_rank}) on {where}, backend {backend_name}, "
            f"rendezvous {os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}")


def init(use_cpu: bool):
    """Join the process group when launched as several processes; the device this rank trains on."""
    import torch
    import torch.distributed as dist

    r = ranks()
    name = backend(use_cpu)
    device = torch.device(f"cuda:{r.local_rank}" if name == "nccl" else "cpu")
    if name == "nccl":
        torch.cuda.set_device(device)
    if r.distributed and not dist.is_initialized():
        dist.init_process_group(name, device_id=device if name == "nccl" else None)
        log.info(describe(r, name))
    return device


def active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensors) -> None:
    """Sum each tensor over all ranks, in place (nothing to do in a single process)."""
    import torch.distributed as dist

    if not active():
        return
    work = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in tensors]
    for w in work:
        w.wait()


def any_rank(flag: bool, device) -> bool:
    """True when ``flag`` is set on any rank: all ranks stop at the same point."""
    import torch
    import torch.distributed as dist

    if not active():
        return flag
    t = torch.tensor(float(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def any_rank_flags(flags: list[bool], device) -> list[bool]:
    """Each flag OR-ed over the ranks, in one collective: all ranks take the same branch."""
    import torch
    import torch.distributed as dist

    if not active():
        return list(flags)
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def barrier() -> None:
    import torch.distributed as dist

    if active():
        dist.barrier()


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
