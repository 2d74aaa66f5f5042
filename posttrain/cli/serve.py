"""``posttrain serve``: the reference inference server (token-id completions and the hot-load API)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="reference inference server: token-id completions and the CoreWeave hot-load API",
        description="Serve a Hugging Face causal LM on 127.0.0.1 with /v1/completions (token ids in and out) "
        "and the v1alpha1 hot-load API over a snapshot chain in a store. Every call needs the bearer token.",
    )
    p.add_argument("--model", type=Path, required=True, help="boot weights: a Hugging Face model folder")
    p.add_argument("--served-model-name", help="name requests give as `model` (default: the folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host other than loopback (reachable from other machines; token only, no TLS)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the URL is printed)")
    p.add_argument("--deployment-id", required=True, help="id of the deployment this server is")
    p.add_argument("--store", required=True, help="where the snapshot chain lives: a folder, file:// or s3:// URI")
    p.add_argument("--prefix", default="", help="prefix in the store; snapshots are <prefix>/<identity>/<file>")
    p.add_argument("--s3-endpoint-url", help="S3 endpoint for an s3:// store (credentials from the environment)")
    p.add_argument("--s3-region", help="S3 region for an s3:// store")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token-env", default="CW_API_TOKEN",
                       help="environment variable holding the bearer token (default CW_API_TOKEN)")
    token.add_argument("--token-file", type=Path, help="file whose first line is the bearer token")
    p.add_argument("--work-dir", type=Path, help="snapshot cache and rebuilt weights (default: a temporary folder)")
    p.add_argument("--engine", choices=["reference", "vllm", "sglang"], default="reference",
                   help="what serves: reference (transformers in this process, the default), vllm (a hot-load "
                   "gateway in front of vLLM servers) or sglang (a hot-load gateway in front of SGLang servers "
                   "someone else runs: not started, supervised or restarted by the gateway)")
    p.add_argument("--engine-url", action="append", default=[], dest="engine_urls", metavar="URL",
                   help="vllm: a vLLM server someone else runs (repeat for more replicas); without any, the "
                   "gateway starts --replicas vLLM servers itself and restarts one that dies. sglang (required): "
                   "an SGLang server (repeat for more replicas) that reads --work-dir at the same paths")
    p.add_argument("--engine-python", type=Path,
                   help="vllm: Python of vLLM's venv (default $VLLM_VENV/bin/python, else .venv-vllm/bin/python)")
    p.add_argument("--engine-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="vllm: --dtype of the vLLM servers it starts (default auto)")
    p.add_argument("--engine-max-model-len", type=int, default=4096,
                   help="vllm: --max-model-len of the vLLM servers it starts (default 4096)")
    p.add_argument("--engine-arg", action="append", default=[], dest="engine_args", metavar="ARG",
                   help="vllm: one more argument for the vLLM servers it starts, e.g. --engine-arg=--max-num-seqs=64")
    p.add_argument("--engine-max-lora-rank", type=int,
                   help="vllm: load LoRA adapters published alone (lora_publish: adapter) at run time, up to this "
                   "rank (--enable-lora --max-lora-rank); default off")
    p.add_argument("--reload", choices=["auto", "in-place", "restart"], default="auto",
                   help="vllm: take new weights in place, by restarting the engine, or auto (restart only where "
                   "in place cannot be trusted: tied embeddings)")
    p.add_argument("--replicas", type=int, default=1,
                   help="replicas the hot-load API reports; vllm: servers the gateway starts (default 1)")
    p.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    p.add_argument("--max-n", type=int, default=64, help="largest n a request may ask")
    p.add_argument("--max-request-tokens", type=int, default=262_144,
                   help="largest n x (prompt + max_tokens) tokens, summed over the prompts, one completions request "
                   "may ask (default 262144)")
    p.add_argument("--probe-interval", type=float, default=2.0, dest="probe_interval_s", metavar="SECONDS",
                   help="seconds between health probes; each reads back what every replica holds: digests of its "
                   "weights, its weight version, its answers to a fixed prompt (default 2)")
    p.add_argument("--idle-probe-interval", type=float, default=60.0, dest="idle_probe_interval_s",
                   metavar="SECONDS", help="engines behind the gateway (vllm, sglang): a replica that answered no "
                   "request since its last readback is read back this often, and only asked /health in between "
                   "(each readback is a request its worker serves; vLLM's then spins a second); 0: at every probe "
                   "(default 60)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve /metrics (Prometheus) on this port of --host instead of the main one: without the "
                   "token when --host is loopback, else with it unless --metrics-no-auth (default: /metrics on the "
                   "main port, behind the token)")
    p.add_argument("--metrics-no-auth", action="store_true",
                   help="/metrics on --metrics-port needs no token even on a non-loopback --host")
    p.add_argument("--max-batch-rows", type=int, default=64, help="sequences sampled together")
    p.add_argument("--test-hooks", action="store_true",
                   help="serve /_test/faults and /_test/stats to inject faults (tests only)")
    p.add_argument("--faults", help="JSON list of faults armed at start (implies --test-hooks)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def _engine_fields(args: argparse.Namespace) -> dict:
    """The vLLM settings given on the command line (none for the reference engine)."""
    if args.engine == "reference":
        return {}
    if args.engine == "sglang":
        return {"engine_urls": args.engine_urls}
    vllm = {"dtype": args.engine_dtype, "max_model_len": args.engine_max_model_len, "extra_args": args.engine_args,
            "max_lora_rank": args.engine_max_lora_rank}
    if args.engine_python is not None:
        vllm["python"] = args.engine_python
    return {"engine_urls": args.engine_urls, "vllm": vllm}


def quiet_openmp(engine: str, environ: dict[str, str]) -> None:
    """The reference engine samples with torch on this process's CPUs, and OpenMP's threads (libgomp)
    spin at every barrier by default, taking CPU from what runs beside the server: the flow's
    shards, the trainer, the Prefect server. Sleeping there instead, a 64-shard round's sampling
    used 1.7 CPU-seconds of the server instead of 3.8-4.6, and took 2.0 s instead of 2.7 with no
    Prefect at all (bench/prefect_overhead.py, 2 CPUs). Set before torch loads, as libgomp reads it
    then; a user's own ``OMP_WAIT_POLICY`` is kept. Engines in processes of their own (vLLM, SGLang)
    tune their threads themselves and inherit nothing from here."""
    if engine == "reference":
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cmd_serve(args: argparse.Namespace) -> int:
    import json
    import logging
    import os
    import signal
    import threading

    from pydantic import ValidationError

    from posttrain import redact
    from posttrain.cli import UsageError
    from posttrain.serve.serve_config import ServeConfig, metrics_need_token, read_token

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_openmp(args.engine, os.environ)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # the server's log: every record scrubbed (S3 credentials...)
        handler.addFilter(redact.LogFilter())
    try:
        token = read_token(file=args.token_file) if args.token_file else read_token(env=args.token_env)
    except ValueError as e:
        raise UsageError(str(e)) from None
    options = {k: v for k, v in (("endpoint_url", args.s3_endpoint_url), ("region", args.s3_region)) if v}
    try:
        faults = json.loads(args.faults) if args.faults else []
    except ValueError:
        raise UsageError("--faults must be a JSON list of faults") from None
    try:
        config = ServeConfig(
            model_dir=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
            allow_remote=args.allow_remote,
            deployment_id=args.deployment_id, store=args.store, prefix=args.prefix, store_options=options,
            token=token, work_dir=args.work_dir, replicas=args.replicas, device=args.device, engine=args.engine,
            reload=args.reload, **_engine_fields(args),
            max_tokens_limit=args.max_tokens_limit, max_n=args.max_n, max_request_tokens=args.max_request_tokens,
            max_batch_rows=args.max_batch_rows, probe_interval_s=args.probe_interval_s,
            idle_probe_interval_s=args.idle_probe_interval_s or None,
            metrics_port=args.metrics_port, metrics_no_auth=args.metrics_no_auth,
            test_hooks=args.test_hooks, faults=faults,
        )
    except ValidationError as e:
        from posttrain.errors import validation_problems

        raise UsageError("; ".join(validation_problems(e))) from None
    from posttrain.serve.server import InferenceServer

    try:
        server = InferenceServer(config)
    except ValueError as e:  # ServeStartError and the engine's refusals name the setting at fault
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"posttrain serve: {server.model_name} for deployment {config.deployment_id} on {server.url}", flush=True)
    if server.metrics_httpd is not None:
        print(f"posttrain serve: /metrics on {server.metrics_url}/metrics"
              f"{'' if metrics_need_token(config) else ' (no token)'}", flush=True)
    if server.service.resumed is not None:
        print(f"posttrain serve: resumed {server.service.resumed}, the version served before the restart "
              f"(recorded in {server.work_dir})", flush=True)
    else:
        # why, as the log says it: no record, or a record that failed its checks or its load
        print(f"posttrain serve: booted clean on {config.model_dir} ({server.service.clean_boot})", flush=True)
    try:
        stop.wait()
    finally:
        server.shutdown()
    return 0
