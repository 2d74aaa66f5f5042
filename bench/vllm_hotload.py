"""Benchmark: checkpoint saved -> vLLM serving it, through ``posttrain serve --engine vllm``, by stage.

A Qwen2 built locally from a config (random init, no downloads; >= 100M parameters by default,
head_dim 64, untied) is published as a FULL snapshot, then one Adam-like step later as a DELTA
(``Publisher``: encode, upload), and each is hot-loaded by ``CoreWeaveHotLoader`` into the gateway,
which runs as its own process (``python -m posttrain serve --engine vllm``) and supervises a real
vLLM (CPU build, ``$VLLM_VENV``). Stage times of the gateway come from the operation's
``status.stageSeconds`` (fetch = download, apply = rebuild, load = validate + pause/reload/resume +
fingerprint); validate (``checks.check_layout``) is timed again here on the rebuilt folder, and
``reload`` = load - validate. Baseline in the same run: restarting vLLM on the new folder
(``VLLMProcess.restart``) until it serves, after the gateway stopped (no two vLLMs at once).

Store: $POSTTRAIN_S3_ENDPOINT, else a SeaweedFS started through scripts/services/start-s3.sh on a
free port; if that fails, a local folder store (the output says which). Prints markdown tables;
asserts nothing.

    VLLM_VENV=... .venv/bin/python bench/vllm_hotload.py [--params 100] [--dtype float32] [--lr 1e-6]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench.publish_hotload import boto_client, drop_bucket, s3_endpoint, s3_fields, say, table  # noqa: E402

MiB = 1 << 20
TOKEN = "bench-token"
DEPLOYMENT = "dep-bench"
NAME = "bench"
PREFIX = "v"
# Qwen2 shapes (head_dim 64, GQA 3:1); the layer count is chosen for the parameter target.
HIDDEN, INTER, HEADS, KV_HEADS = 768, 3072, 12, 4


# ---------------------------------------------------------------------- models
def build_models(out: Path, params_m: float, dtype: str, lr: float) -> tuple[Path, Path, int, int]:
    """A Qwen2 of at least ``params_m`` million parameters (fp32 master weights, saved in ``dtype``)
    and the same model one Adam-like step later; both with the tiny tokenizer (its vocabulary is
    the model's, so every token vLLM samples decodes)."""
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.tiny import build_tiny_tokenizer
    from posttrain.testing.synthetic import adam_update

    tok = build_tiny_tokenizer(512)
    vocab = len(tok)
    kv = HIDDEN // HEADS * KV_HEADS
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 2 * kv + HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
    layers = max(1, math.ceil((params_m * 1e6 - 2 * vocab * HIDDEN - HIDDEN) / per_layer))
    config = Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(getattr(torch, dtype))
    m0, m1 = out / "checkpoint-1", out / "checkpoint-2"
    model.save_pretrained(m0)
    tok.save_pretrained(m0)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            step = torch.from_numpy(adam_update(rng, tuple(p.shape), 2))
            p.copy_((master[name] + lr * step).to(p.dtype))
    model.save_pretrained(m1)
    tok.save_pretrained(m1)
    return m0, m1, params, layers


# ---------------------------------------------------------------------- processes
def status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


class RssWatch:
    """Peak RSS of the gateway (VmHWM) and of vLLM's processes together (sampled VmRSS sum)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.vllm_peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from posttrain.serve.vllm.process import group_pids

        while not self._stop.wait(0.5):
            pids = [p for leader in children(self.pid) for p in group_pids(leader)]
            self.vllm_peak = max(self.vllm_peak, sum(status_kib(p, "VmRSS") for p in pids))

    def gateway_peak_kib(self) -> int:
        return status_kib(self.pid, "VmHWM")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def start_gateway(m0: Path, work: Path, store_args: list[str], dtype: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "CW_API_TOKEN": TOKEN, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "PYTHONPATH": str(ROOT)}
    out = work / "gateway.out"
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "posttrain", "serve", "--model", str(m0), "--served-model-name", NAME,
           "--port", "0", "--deployment-id", DEPLOYMENT, *store_args, "--prefix", PREFIX,
           "--work-dir", str(work / "serve"), "--engine", "vllm", "--engine-dtype", dtype,
           "--engine-max-model-len", "256", "--log-level", "warning"]
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        for line in out.read_text(errors="replace").splitlines():
            if line.startswith("posttrain serve:"):
                return proc, line.rsplit(" ", 1)[1]
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited ({proc.returncode}):\n{out.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the gateway did not start in 900 s")


def stop_gateway(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def vllm_version() -> str:
    from posttrain.serve.vllm.process import default_python

    venv = default_python().parent.parent
    for dist in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info")):
        return dist.name.removesuffix(".dist-info")
    return "unknown"


# ---------------------------------------------------------------------- the run
def run(data: Path, store_kind: str, endpoint: str | None, bucket: str | None, args: argparse.Namespace) -> None:
    from posttrain.chain.policy import ChainPolicy
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
    from posttrain.publish import PublishConfig, Publisher
    from posttrain.serve.checks import check_layout, folder_layout
    from posttrain.serve.vllm.process import VLLMProcess, VLLMProcessConfig
    from posttrain.storage import LocalStore, S3Store, S3StoreConfig

    say(f"building a Qwen2 of >= {args.params:g}M params ({args.dtype}) and the same one Adam step later ...")
    m0, m1, params, layers = build_models(data / "ckpts", args.params, args.dtype, args.lr)
    if store_kind == "s3":
        store = S3Store(S3StoreConfig(bucket=bucket, prefix=PREFIX, **s3_fields(endpoint)))
        store_args = ["--store", f"s3://{bucket}", "--s3-endpoint-url", endpoint, "--s3-region", "us-east-1"]
    else:
        store = LocalStore(data / "store" / PREFIX)
        store_args = ["--store", str(data / "store")]
    publisher = Publisher(store, PublishConfig(run="bench", work_dir=data / "publish", async_publish=False,
                                               policy=ChainPolicy()))
    say("starting the gateway (it starts vLLM and waits for its first token) ...")
    t0 = time.perf_counter()
    gateway, url = start_gateway(m0, data / "gw", store_args, args.dtype)
    boot = time.perf_counter() - t0
    watch = RssWatch(gateway.pid)
    expected = folder_layout(m0)
    loader = CoreWeaveHotLoader(HotLoadConfig(api_url=url, deployment_id=DEPLOYMENT, token=TOKEN,
                                              poll_interval=0.05, timeout=900))
    rows, full_bytes, delta = [], None, None
    try:
        for ckpt in (m0, m1):
            say(f"{ckpt.name}: publish and hot-load ...")
            t0 = time.perf_counter()
            publisher.submit(ckpt)  # synchronous: spool, encode, upload, ledger
            snap = publisher.published[-1]
            published = time.perf_counter() - t0
            t1 = time.perf_counter()
            result = loader.hot_load(snap.identity, base_identity=snap.base if snap.kind == "delta" else None)
            client = time.perf_counter() - t1
            stages = loader.get_operation(result.operation_id)["status"]["stageSeconds"]
            rebuilt = next((data / "gw" / "serve" / "models").glob(f"{snap.identity}-*"))
            t2 = time.perf_counter()
            check_layout(rebuilt, expected)
            validate = time.perf_counter() - t2
            full_bytes = full_bytes or snap.stored_bytes
            row = dict(kind=snap.kind, mib=snap.stored_bytes / MiB, pct=100 * snap.stored_bytes / full_bytes,
                       encode=snap.encode_seconds, upload=snap.upload_seconds, download=stages["fetch"],
                       rebuild=stages["apply"], validate=validate, reload=stages["load"] - validate,
                       client=client, total=published + client)
            rows.append(row)
            if snap.kind == "delta":
                delta = row
        gateway_kib = watch.gateway_peak_kib()
    finally:
        watch.stop()
        loader.close()
        stop_gateway(gateway)
        publisher.close()
        store.close()

    say("baseline: vLLM started on the full checkpoint, then restarted on the new folder ...")
    process = VLLMProcess(VLLMProcessConfig(served_model_name=NAME, dtype=args.dtype, max_model_len=256,
                                            log_file=data / "restart-vllm.log"))
    t0 = time.perf_counter()
    process.start(m0)
    cold = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        process.restart(m1)
        restart = time.perf_counter() - t0
    finally:
        process.stop()

    print(f"### Checkpoint saved -> vLLM serving it: Qwen2 {params / 1e6:.0f}M params ({layers} layers, hidden "
          f"{HIDDEN}, head_dim {HIDDEN // HEADS}, untied), {args.dtype}; delta = one Adam-like step at lr "
          f"{args.lr:g} (seconds)\n")
    print(f"Machine: {os.cpu_count()} cores (shared), {vllm_version()} (CPU build), dtype {args.dtype}; store: "
          + ("SeaweedFS (S3) on loopback" if store_kind == "s3" else "a local folder (SeaweedFS could not start)")
          + "\n")
    fmt = "{:.2f}".format
    out = []
    for r in rows:
        out.append([r["kind"], f"{r['mib']:.1f}", f"{r['pct']:.1f}%", fmt(r["encode"]), fmt(r["upload"]),
                    fmt(r["download"]), fmt(r["rebuild"]), f"{r['validate']:.3f}", fmt(r["reload"]),
                    f"{fmt(r['client'])} / **{fmt(r['total'])}**"])
    if delta is not None:
        known = delta["encode"] + delta["upload"] + delta["download"] + delta["rebuild"] + delta["validate"]
        out.append(["restart baseline (delta's stages, then `VLLMProcess.restart`)", f"{delta['mib']:.1f}",
                    f"{delta['pct']:.1f}%", fmt(delta["encode"]), fmt(delta["upload"]), fmt(delta["download"]),
                    fmt(delta["rebuild"]), f"{delta['validate']:.3f}", f"{fmt(restart)} (restart)",
                    f"— / **{fmt(known + restart)}** (sum)"])
    table(["snapshot", "stored MiB", "of full", "encode", "upload", "download", "rebuild", "validate",
           "reload", "hot-load (client) / total"], out)
    print("`reload` = the gateway's load stage less `validate`: pause, reload_weights, resume, and the fingerprint "
          "requests before and after. `hot-load (client)` is what `CoreWeaveHotLoader.hot_load` took (polls "
          "included); `total` adds publish (spool, encode, upload). Single runs.\n")
    print(f"Gateway boot (vLLM cold start + first token): {boot:.1f} s; a bare `VLLMProcess.start`: {cold:.1f} s. "
          f"Peak RSS: gateway process {gateway_kib / 1024:.0f} MiB; vLLM's processes together (sampled) "
          f"{watch.vllm_peak / 1024:.0f} MiB.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100, help="model size in millions of parameters (at least)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="checkpoint dtype and vLLM's --dtype")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of the Adam-like step of the delta")
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="posttrain-bench-vllm-"))
    t0 = time.perf_counter()
    try:
        try:
            ctx = s3_endpoint(data)
            endpoint = ctx.__enter__()
        except SystemExit as e:
            say(f"no SeaweedFS ({e}); using a local folder store")
            run(data, "local", None, None, args)
        else:
            try:
                client = boto_client(endpoint)
                bucket = f"bench-{uuid.uuid4().hex[:8]}"
                client.create_bucket(Bucket=bucket)
                try:
                    run(data, "s3", endpoint, bucket, args)
                finally:
                    drop_bucket(client, bucket)
            finally:
                ctx.__exit__(None, None, None)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    say(f"done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
