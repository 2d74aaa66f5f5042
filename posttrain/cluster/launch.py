"""The per-node command line: the job's command behind torchrun, accelerate or nothing.

Topology flags come only from ``nodes`` and ``gpus_per_node``; the node rank and rendezvous
address are shell variables the backend sets (``$SLURM_NODEID`` on Slurm, ``$JOB_COMPLETION_INDEX``
on Kubernetes, ``$MASTER_ADDR``/``$MASTER_PORT`` on both).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Launcher = Literal["torchrun", "accelerate", "python"]
LAUNCHERS: tuple[str, ...] = ("torchrun", "accelerate", "python")

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
# accelerate picks its distributed mode from these; without them a multi-process run needs --multi_gpu
_ACCELERATE_MODE_FLAGS = ("--config_file", "--config-file", "--use_deepspeed", "--use_fsdp", "--use_megatron_lm")


@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus_per_node: int
    node_rank: str  # a shell expression such as "$SLURM_NODEID"
    master_addr: str = "$MASTER_ADDR"
    master_port: str = "$MASTER_PORT"

    @property
    def procs_per_node(self) -> int:
        return max(1, self.gpus_per_node)


def is_python(program: str) -> bool:
    return bool(_PYTHON.fullmatch(posixpath.basename(program)))


def no_python(launcher_args: Sequence[str]) -> bool:
    """Whether the launcher is told to run the program as is (torchrun ``--no-python``, accelerate
    ``--no_python``): then the command may be any program, started once per process."""
    return any(a.lstrip("-").split("=", 1)[0].replace("-", "_") == "no_python" for a in launcher_args)


def python_target(command: Sequence[str], launcher: str) -> list[str]:
    """What follows ``python`` in the command, as torchrun/accelerate take it: ``-m module args``
    or ``script.py args``. ``ValueError`` when the command cannot be launched that way."""
    if not is_python(command[0]):
        raise ValueError(
            f"launcher {launcher} runs Python: the command must start with python, not {command[0]!r}; "
            "run another program as is with launcher: python (one node), or once per process with "
            f"launcher_args: [{'--no_python' if launcher == 'accelerate' else '--no-python'}]"
        )
    rest = list(command[1:])
    if not rest:
        raise ValueError(f"launcher {launcher} needs a module (-m name) or a script after python")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise ValueError("python -m needs a module name")
        return rest
    if rest[0].startswith("-"):
        raise ValueError(
            f"launcher {launcher} takes 'python -m module ...' or 'python script.py ...', "
            f"not the interpreter flag {rest[0]}"
        )
    return rest


def launch_line(launcher: str, launcher_args: Sequence[str], command: Sequence[str], topo: Topology) -> str:
    """Shell line that starts ``command`` on one node."""
    q = shlex.quote
    rank, addr, port = f'"{topo.node_rank}"', f'"{topo.master_addr}"', f'"{topo.master_port}"'
    if launcher == "python":
        return " ".join(q(a) for a in command)
    program = list(command) if no_python(launcher_args) else python_target(command, launcher)
    target = " ".join(q(a) for a in program)
    extra = "".join(" " + q(a) for a in launcher_args)
    if launcher == "torchrun":
        return (
            f"torchrun --nnodes={topo.nodes} --nproc_per_node={topo.procs_per_node} --node_rank={rank}"
            f" --master_addr={addr} --master_port={port}{extra} {target}"
        )
    if launcher == "accelerate":
        total = topo.nodes * topo.procs_per_node
        multi = total > 1 and not any(a.split("=", 1)[0] in _ACCELERATE_MODE_FLAGS for a in launcher_args)
        return (
            f"accelerate launch --num_machines={topo.nodes} --num_processes={total} --machine_rank={rank}"
            f" --main_process_ip={addr} --main_process_port={port}{' --multi_gpu' if multi else ''}{extra} {target}"
        )
    raise ValueError(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")
