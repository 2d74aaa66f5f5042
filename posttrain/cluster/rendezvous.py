"""Where the nodes of a multi-node job meet (``MASTER_ADDR``), on every backend by one rule: the
address the nodes can reach, which the backend knows, unless the cluster's ``rdzv_host`` says
otherwise; dry runs say which.

- Slurm: the NodeAddr of the allocation's first node (``scontrol show node``), the address Slurm
  itself reaches the node by, falling back to the node's name. Node names need not resolve: with
  several slurmd on one host (``n1``, ``n2``) they do not, which is why submitit's first-node-name
  default does not do here.
- Kubernetes: pod 0's stable name through the job's headless Service.
"""

from __future__ import annotations

import shlex

from posttrain.cluster.config import KubernetesConfig, SlurmConfig


def slurm_setup(config: SlurmConfig) -> list[str]:
    """sbatch setup lines that export MASTER_ADDR."""
    if config.rdzv_host:
        return [f"export MASTER_ADDR={shlex.quote(config.rdzv_host)}  # rdzv_host"]
    return [
        'mapfile -t posttrain_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "# rendezvous: the first node's NodeAddr (what Slurm reaches it by), else its name",
        r"""MASTER_ADDR="$(scontrol show node "${posttrain_nodes[0]}" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)" || true""",  # noqa: E501
        'export MASTER_ADDR="${MASTER_ADDR:-${posttrain_nodes[0]}}"',
    ]


def slurm_note(config: SlurmConfig) -> str:
    """The dry run's line about the rendezvous address."""
    if config.rdzv_host:
        where = f"{config.rdzv_host} (the cluster's rdzv_host)"
    else:
        where = "the NodeAddr of the allocation's first node (scontrol show node), else its name (rdzv_host overrides)"
    return f"# rendezvous: MASTER_ADDR is {where}; MASTER_PORT={config.master_port}"


def k8s_address(config: KubernetesConfig, name: str) -> str:
    """``rdzv_host`` when set, else pod 0's name through the headless Service ``name``."""
    return config.rdzv_host or f"{name}-0.{name}.{config.namespace}.svc.cluster.local"


def k8s_note(config: KubernetesConfig, name: str) -> str:
    """The dry run's line about the rendezvous address (ends with a newline)."""
    if config.rdzv_host:
        where = f"{config.rdzv_host} (the cluster's rdzv_host)"
    else:
        where = f"{k8s_address(config, name)} (pod 0 through the headless Service; rdzv_host overrides)"
    return f"# rendezvous: MASTER_ADDR is {where}; MASTER_PORT={config.master_port}\n"
