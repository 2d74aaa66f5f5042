"""Deployment steps that ``prefect.yaml`` runs when ``prefect deploy`` builds a deployment."""

from __future__ import annotations

import os


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
                            "deploy the others alone: prefect --no-prompt deploy --name nightly --name grpo")
    return {n: os.environ[n] for n in names}
