"""Checks shared by the backend settings. Each raises ``ValueError`` with a message that pydantic
or ``ConfigError`` prefixes with the field name."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping

from posttrain import redact
from posttrain.redact import secret_name  # the name rule of credentials lives with the masking

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SLURM_VALUE = re.compile(r"^[A-Za-z0-9_:.+-]+$")

# Launcher flags that set the topology: posttrain derives it from nodes and gpus_per_node.
TOPOLOGY_FLAGS = frozenset(
    {
        "nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "standalone",
        "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts",
        "num_machines", "num_processes", "machine_rank", "main_process_ip", "main_process_port",
        "same_network", "multi_gpu",
    }
)  # fmt: skip

def dns_label(value: str, max_len: int = 63) -> str:
    if len(value) > max_len:
        raise ValueError(f"{value!r} is {len(value)} characters long; at most {max_len} are allowed")
    if not DNS_LABEL.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a DNS-1123 label (lowercase letters, digits and '-', "
            "starting and ending with a letter or digit)"
        )
    return value


def env_names(env: Mapping[str, str], reserved: Iterable[str] = (), reserved_prefixes: Iterable[str] = ()) -> None:
    reserved = set(reserved)
    prefixes = tuple(reserved_prefixes)
    for name in env:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid environment variable name")
        if name in reserved or name.startswith(prefixes):
            raise ValueError(f"{name} is set by posttrain itself and cannot be overridden")


def no_plain_secrets(env: Mapping[str, str], where: str = "secrets") -> None:
    """Refuse credentials in plain ``env`` (it is written into job files and dry-run output): by
    name (``redact.secret_name``) or by value (``redact.credential_in``: a URL with a user or
    password or a credential in its query, a connection string's key). The message never shows
    the value."""
    for name, value in env.items():
        if secret_name(name):
            why = "its name says it is a credential"
        elif (found := redact.credential_in(value)) is not None:
            why = f"its value is {found}"
        else:
            continue
        raise ValueError(
            f"{name}: {why}; plain env values are written into the job's files and shown by --dry-run. "
            f"List the name under {where} instead: the job then gets the value from the submitting "
            "environment, and nothing shows it"
        )


def secret_names(names: Iterable[str], reserved: Iterable[str] = (), reserved_prefixes: Iterable[str] = ()) -> None:
    """The ``secrets:`` list: valid, unreserved, distinct environment variable names."""
    names = list(names)
    env_names(dict.fromkeys(names, ""), reserved, reserved_prefixes)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} listed more than once")


def launcher_args(args: Iterable[str]) -> None:
    for arg in args:
        if not arg.startswith("-"):
            continue
        flag = arg.lstrip("-").split("=", 1)[0].replace("-", "_")
        if flag in TOPOLOGY_FLAGS:
            raise ValueError(
                f"{arg.split('=', 1)[0]} sets the topology; posttrain derives it from nodes and "
                "gpus_per_node, remove it"
            )


def absolute_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path")
    if ".." in value.split("/"):
        raise ValueError(f"{value!r} contains '..'")
    if re.search(r"[\s,:]", value):
        raise ValueError(f"{value!r} contains whitespace, ',' or ':' (container mounts cannot express it)")
    return posixpath.normpath(value)


def is_under(path: str, roots: Iterable[str]) -> bool:
    path = posixpath.normpath(path)
    for root in roots:
        root = posixpath.normpath(root)
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return True
    return False


_TIME_FORMATS = [
    (re.compile(r"^(\d+)$"), ("m",)),
    (re.compile(r"^(\d+):(\d+)$"), ("m", "s")),
    (re.compile(r"^(\d+):(\d+):(\d+)$"), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$"), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d+)$"), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$"), ("d", "h", "m", "s")),
]
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def time_limit_seconds(value: str) -> int:
    """Seconds in a Slurm time limit: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``."""
    for pattern, units in _TIME_FORMATS:
        m = pattern.fullmatch(value.strip())
        if m:
            seconds = sum(int(g) * _UNIT_S[u] for g, u in zip(m.groups(), units))
            if seconds <= 0:
                raise ValueError(f"{value!r} is not a positive duration")
            return seconds
    raise ValueError(f"{value!r} is not a Slurm time limit (MM, HH:MM:SS or D-HH:MM:SS)")


K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][0-9]+)?$")


def k8s_quantity(value: str) -> str:
    if not K8S_QUANTITY.fullmatch(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 32, 500m, 256Gi)")
    return value
