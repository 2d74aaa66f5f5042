"""Deployment steps that ``prefect.yaml`` runs when ``prefect deploy`` builds a deployment."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import yaml

# How prefect.yaml names this module's step; `prefect deploy` reads prefect.yaml from the folder it runs in.
REQUIRE_ENV_STEP = f"{__name__}.require_env"
PREFECT_FILE = "prefect.yaml"


class DeployStopped(SystemExit):
    """A deploy-time check failed. A ``SystemExit`` whose code is the message: Prefect wraps any
    ``Exception`` a step raises into ``StepExecutionError`` and prints a ~30-line traceback, but
    lets ``SystemExit`` through, and Python prints its message as one line and exits 1."""


def require_env(names: list[str], purpose: str = "") -> dict[str, str]:
    """Stop the deploy when an environment variable a deployment needs is unset or empty.

    ``prefect deploy`` turns an unset ``{{ $VAR }}`` into an empty string (the Kubernetes
    deployment would then deploy with ``image: ''`` and fail only when a pod starts). Returns the
    values, so later steps or fields can use ``{{ <step id>.<NAME> }}``.
    """
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        why = f" ({purpose})" if purpose else ""
        raise DeployStopped(f"set {', '.join(missing)} before deploying{why}. Without Kubernetes, "
                            f"deploy the others alone: {deploy_others_command()}")
    return {n: os.environ[n] for n in names}


def deploy_others_command(prefect_file: str | Path = PREFECT_FILE) -> str:
    """The command that deploys every deployment of ``prefect_file`` whose build does not run
    ``require_env`` (all a site without Kubernetes needs: nightly, grpo, promote, rollback, ...),
    read from the file so that a deployment added to it is in the suggestion too."""
    try:
        doc = yaml.safe_load(Path(prefect_file).read_text()) or {}
        names = [d["name"] for d in doc.get("deployments") or []
                 if not any(REQUIRE_ENV_STEP in step for step in d.get("build") or [])]
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        names = []
    if not names:  # no readable file here: say how, not which
        return "prefect --no-prompt deploy --name NAME --name NAME ... (the deployments of prefect.yaml you use)"
    return "prefect --no-prompt deploy " + " ".join(f"--name {shlex.quote(n)}" for n in names)
