"""Deployment steps that ``prefect.yaml`` runs when ``prefect deploy`` builds a deployment."""

from __future__ import annotations

import os


def require_env(names: list[str], purpose: str = "") -> dict[str, str]:
    """Stop the deploy when an environment variable a deployment needs is unset or empty.

    ``prefect deploy`` turns an unset ``{{ $VAR }}`` into an empty string (the Kubernetes
    deployment would then deploy with ``image: ''`` and fail only when a pod starts). Returns the
    values, so later steps or fields can use ``{{ <step id>.<NAME> }}``.
    """
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        why = f" ({purpose})" if purpose else ""
        raise ValueError(f"set {', '.join(missing)} before deploying{why}; deploy the other deployments "
                         "alone with prefect deploy --name nightly --name grpo")
    return {n: os.environ[n] for n in names}
