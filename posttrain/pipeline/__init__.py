"""The Prefect pipeline: the only package that imports prefect (besides the CLI commands that
start flows).

- ``settings``: the flows' typed parameters (plain pydantic; deployments enforce them);
- ``flows``: the nightly flow and the GRPO flow (rollout shards as mapped subflows);
- ``tasks``: a few lines each, calling the engines below (``runs``, ``publish``, ``inference``,
  ``rollouts``, ``datasets``), plus artifacts and retry rules;
- ``blocks``: Prefect blocks for clusters, object stores and inference deployments;
- ``deployments``: work pools and blocks a server needs, and the embedded defaults.
"""
