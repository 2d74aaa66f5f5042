"""The chaos soak (``bench/soak.py``, issue 35): the whole system on one machine, compressed nights,
faults from a seeded schedule, and a folder that an independent checker (``check.py``) reads.

THE SOAK FOLDER CONTRACT: the single source; the driver writes it, the checker relies on it. Every
``.jsonl`` file is one JSON object a line, written line-buffered as events happen (a soak that dies
leaves what it saw). Times are ISO 8601 UTC strings (``at``, ``*_at``) unless named ``*_s``.

``soak.json`` (written at the start, rewritten at the end with ``ended_at``)::

    {"seed": int, "minutes": float, "backend": "local"|"slurm",
     "started_at": ISO, "ended_at": ISO or null while running,
     "store": {"endpoint_url": the real SeaweedFS (not the fault proxy), "bucket": str,
               "prefix": str ("" for none), "region": str},
     "credentials_env": {"access_key": ENVVAR, "secret_key": ENVVAR},   # names only, never values
     "prefect_api_url": str,
     "deployments": {"production": DEPLOYMENT, "staging": DEPLOYMENT, "rollouts": DEPLOYMENT},
     "gateway_token_env": ENVVAR or null,
     "max_staleness": 1, "work_pool": str, "run_dirs": [folders holding <run>/ of every run],
     "base_model": the tiny model folder every gateway boots on (its replies stamped null),
     "served_model_name": str, "nights": int, "night_s": float,
     "spool": {"kind": "tmpfs"|"none", "path": str, "size_mib": int, "why": str},
     "unfinished_runs": [flow run ids not in a terminal state when the drain gave up],
     "summary": {"faults_by_kind": {kind: n}, "runs": n, "replies": n, "wall_s": float}}

    DEPLOYMENT = {"deployment_id": the hot-load id and the history's name,
                  "gateway_url": its /v1/completions base URL while the soak ran (stopped at the end),
                  "history": {"prefix": the store prefix, "deployment": the history's name}
                             (posttrain history --store s3://<bucket> --prefix <prefix> --deployment <name>),
                  "block": the Prefect block ``posttrain-inference-deployment/<name>``,
                  "work_dir": the gateway's --work-dir (its state.json: the version it served last),
                  "final": {"health": its /health at quiesce, "metrics_file": logs/<role>-metrics.txt} or null}

    Production's history is the promotion history; staging and rollouts have none (their history
    key is null). The gateways are stopped at the end: "final" is what each said at quiesce.

``schedule.jsonl``: one line per planned fault, in time order (``posttrain.testing.soak.schedule``)::

    {"at_s": seconds after the start, "kind": KIND, "target": str, "duration_s": float}

    KIND in worker_kill, trainer_kill, store_outage, serve_kill, prefect_restart, postgres_restart,
    spool_full. Targets: worker_kill "worker"; trainer_kill "nightly"|"grpo" (that kind's trainer
    if one runs, else any); store_outage "refused"|"503"|"slow"; serve_kill "production"|"staging"|
    "rollouts"; prefect_restart "prefect-server"; postgres_restart "postgresql"; spool_full "shared".
    duration_s: how long the fault lasts (the outage, the disk full, the service down, the delay
    before a supervisor restarts what was killed); 0 for trainer_kill (nothing restarts a trainer
    but the product itself).

``faults.jsonl``: one line per injected fault, when it ended::

    {"kind": KIND, "target": str, "started_at": ISO, "ended_at": ISO, "detail": str,
     "planned_at_s": float, "injected": bool}

    injected is false when there was nothing to hit (no trainer ran within the bound): the detail
    says so, and the checker does not count it.

``runs.jsonl``: one line per run the nights started::

    {"flow_run_id": str, "deployment": "<flow>/<deployment>", "kind": "nightly"|"grpo", "night": int,
     "started_at": ISO, "run_name": str}

``operator.jsonl``: one line per operator action, when it ended::

    {"at": ISO (its start), "action": "rollback"|"promote"|"gc", "argv": [str], "rc": int,
     "output_tail": str, "flow_run_id": str or null (promote: the promote deployment's flow run)}

``replies.jsonl``: one line per completions request to production, greedy::

    {"at": ISO, "deployment": "production", "status": HTTP status or 0 when no reply came,
     "identity": the reply's body field ``snapshot_identity`` (null: the boot weights, or no reply),
     "prompt_ids": [int], "token_ids": [int] or null, "logprobs": [float] or null,
     "max_tokens": int, "temperature": 0.0, "error": str or null}

``logs/``: the driver's log (``driver.log``), the worker's and each gateway's, the proxy's
counters, the final /health and /metrics of each gateway, the Prefect yaml it deployed.
"""

from __future__ import annotations

KINDS = ("worker_kill", "trainer_kill", "store_outage", "serve_kill", "prefect_restart", "postgres_restart",
         "spool_full")
ROLES = ("production", "staging", "rollouts")  # the gateways; production is the one with a history
OUTAGE_MODES = ("refused", "503", "slow")
FILES = ("soak.json", "schedule.jsonl", "faults.jsonl", "runs.jsonl", "operator.jsonl", "replies.jsonl")
TOKEN_ENV = "SOAK_GATEWAY_TOKEN"
ACCESS_KEY_ENV, SECRET_KEY_ENV = "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"
