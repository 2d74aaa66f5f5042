"""A job's ``secrets:``: names of variables whose values come from the submitting environment at
submit time and are never written into a rendered file nor shown.

Each backend hands them over its own way: Slurm writes ``secrets.env`` (mode 0600) into the job
folder on shared storage and ``node.sh`` sources it; Kubernetes puts them in a Secret owned by the
Job and the containers read it through ``envFrom``; the local backend passes them in the job's
environment. Values read here are also handed to ``posttrain.redact``, so a scheduler or API error
that echoes one shows ``***`` instead.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping

from posttrain import redact
from posttrain.cluster.errors import ConfigError

SECRETS_FILE = "secrets.env"


def read(names: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values of ``names`` in the submitting environment; ``ConfigError`` naming every one that
    is unset or empty (never a value)."""
    environ = os.environ if environ is None else environ
    names = list(names)
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise ConfigError(
            "cluster.secrets",
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (or empty) in the submitting "
            "environment; export {} before submitting".format(" and ".join(missing)),
        )
    values = {n: environ[n] for n in names}
    redact.remember(*values.values())
    return values


def shell_file(values: Mapping[str, str]) -> str:
    """``secrets.env``: one ``NAME='value'`` line each, for ``set -a; source``."""
    lines = ["# posttrain: the job's secrets, from the submitting environment; sourced by node.sh"]
    lines += [f"{name}={shlex.quote(value)}" for name, value in sorted(values.items())]
    return "\n".join(lines) + "\n"


def describe(names: Iterable[str]) -> str:
    """What a dry run shows: the names, and where the values will come from."""
    return f"{', '.join(sorted(names))} (values read from the submitting environment at submit time; not shown)"
