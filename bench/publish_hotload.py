"""Benchmark: publish throughput to S3, and checkpoint saved -> hot-loaded latency by stage.

(a) A full snapshot of a synthetic bf16 checkpoint (``adam_like_pair``) uploaded to the S3
    server through ``S3Store``: multipart with several part sizes and parts in flight, against
    one single-stream PUT per file, alternated in the same run.
(b) posttrain's reference server (in process) booted from a Qwen2 model built locally from a
    config (~125M parameters, bf16): a checkpoint goes through ``Publisher`` (encode, upload)
    and ``CoreWeaveHotLoader`` (the server fetches, applies, loads and swaps; its stage times
    come from the operation's ``status.stageSeconds``), for a full snapshot and for a delta
    one Adam step later, next to the I/O floor of the same bytes (local copy, read, raw boto3
    PUT and GET).

S3: $POSTTRAIN_S3_ENDPOINT, else a SeaweedFS started here through scripts/services/start-s3.sh
on a free port and stopped at the end. Prints markdown tables; asserts nothing.

    .venv/bin/python bench/publish_hotload.py [--mib 512] [--parts 32x8,64x8,64x4,128x4] [--repeat 3] [--lr 1e-6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from posttrain.storage import S3Store, S3StoreConfig  # noqa: E402

MiB = 1 << 20
TOKEN = "bench-token"
DEPLOYMENT = "dep-bench"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_endpoint(work: Path) -> Iterator[str]:
    """$POSTTRAIN_S3_ENDPOINT, or a SeaweedFS of our own for the duration."""
    given = os.environ.get("POSTTRAIN_S3_ENDPOINT")
    if given:
        yield given.rstrip("/")
        return
    port = free_port()
    env = {**os.environ, "S3_PORT": str(port), "POSTTRAIN_S3_DIR": str(work / "s3"),
           "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent)}
    scripts = ROOT / "scripts" / "services"
    started = subprocess.run(["bash", str(scripts / "start-s3.sh")], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        raise SystemExit(f"start-s3.sh failed:\n{started.stdout}{started.stderr}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["bash", str(scripts / "stop-s3.sh")], env=env, capture_output=True)


def s3_fields(endpoint: str) -> dict:
    return dict(endpoint_url=endpoint, region="us-east-1", access_key_id="bench", secret_access_key="bench",
                addressing_style="path")


def boto_client(endpoint: str):  # noqa: ANN201 - a boto3 client
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                        aws_secret_access_key="bench",
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=16))


def drop_bucket(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def nbytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in files_of(folder))


def timed(fn, repeat: int = 1) -> float:
    """Seconds of ``fn()``, the fastest of ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


# ---------------------------------------------------------------------- (a) throughput
def upload_throughput(endpoint: str, bucket: str, data: Path, mib: int, parts: list[tuple[int, int]],
                      repeat: int) -> None:
    from posttrain.chain.ops import encode_snapshot
    from posttrain.testing.synthetic import adam_like_pair

    say(f"(a) building a {mib} MiB synthetic bf16 checkpoint and its full snapshot ...")
    base, _ = adam_like_pair(data / "syn-base", data / "syn-new", total_bytes=mib * MiB, lr=1e-6, seed=1, warmup=1)
    snap = encode_snapshot(base, data / "syn-chain", run="bench", step=1)
    size = nbytes(snap.path)
    largest = max(p.stat().st_size for p in files_of(snap.path))
    modes = {f"multipart ({part_mib} MiB parts, {inflight} in flight)": dict(part_size=part_mib * MiB,
                                                                          max_concurrency=inflight)
             for part_mib, inflight in parts}
    single = "single stream (one PUT per file)"
    modes[single] = dict(part_size=max(5 * MiB, largest + MiB), max_concurrency=1)
    client = boto_client(endpoint)
    secs: dict[str, list[float]] = {m: [] for m in modes}
    etags: dict[str, str] = {}
    for r in range(repeat):
        for mode in (list(modes) if r % 2 == 0 else list(reversed(modes))):  # alternate the order
            prefix = f"a/{uuid.uuid4().hex[:8]}"
            with S3Store(S3StoreConfig(bucket=bucket, prefix=prefix, **s3_fields(endpoint), **modes[mode])) as s:
                secs[mode].append(timed(lambda s=s: [s.put_file(p, f"{snap.identity}/{p.name}")
                                                       for p in files_of(snap.path)]))
            shard = next(p.name for p in files_of(snap.path) if p.suffix == ".safetensors")
            etags[mode] = client.head_object(Bucket=bucket, Key=f"{prefix}/{snap.identity}/{shard}")["ETag"]
    best = {m: size / min(v) / 1e6 for m, v in secs.items()}
    print(f"### (a) Publish throughput to S3: one full snapshot of {size / MiB:.0f} MiB "
          f"({len(files_of(snap.path))} files, largest {largest / MiB:.0f} MiB), {os.cpu_count()} cores, "
          f"best of {repeat}\n")
    rows = []
    for mode, times in secs.items():
        parts = etags[mode].strip('"').partition("-")[2] or "1"
        rows.append([mode, parts, " / ".join(f"{t:.2f}" for t in times), f"{best[mode]:.0f}"])
    rows = [row + [f"{best[mode] / best[single]:.2f}x"] for row, mode in zip(rows, secs, strict=True)]
    table(["upload", "parts (ETag)", "seconds per run", "MB/s (best)", "vs single stream"], rows)
    for name in ("syn-base", "syn-new", "syn-chain"):
        shutil.rmtree(data / name)


# ---------------------------------------------------------------------- (b) hot-load latency
def build_models(out: Path, lr: float) -> tuple[Path, Path, int]:
    """A Qwen2 from a config (fp32 master weights, saved in bf16) and the same one Adam step later."""
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.testing.synthetic import adam_update

    config = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(torch.bfloat16)
    m0, m1 = out / "checkpoint-1", out / "checkpoint-2"
    model.save_pretrained(m0)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            step = torch.from_numpy(adam_update(rng, tuple(p.shape), 2))
            p.copy_((master[name] + lr * step).to(torch.bfloat16))
    model.save_pretrained(m1)
    return m0, m1, params


def hotload_latency(endpoint: str, bucket: str, data: Path, lr: float) -> None:
    from boto3.s3.transfer import TransferConfig
    from pydantic import SecretStr

    from posttrain.chain.policy import ChainPolicy
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
    from posttrain.publish import PublishConfig, Publisher
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    say("(b) building a Qwen2 model (bf16) and the same one Adam step later ...")
    m0, m1, params = build_models(data / "ckpts", lr)
    prefix = "b"
    store = S3Store(S3StoreConfig(bucket=bucket, prefix=prefix, **s3_fields(endpoint)))
    publisher = Publisher(store, PublishConfig(run="bench", work_dir=data / "publish", async_publish=False,
                                               policy=ChainPolicy()))
    say("(b) starting the reference server ...")
    server = InferenceServer(ServeConfig(
        model_dir=m0, port=0, deployment_id=DEPLOYMENT, store=f"s3://{bucket}", prefix=prefix,
        store_options=s3_fields(endpoint), token=SecretStr(TOKEN), work_dir=data / "serve",
    )).start()
    loader = CoreWeaveHotLoader(HotLoadConfig(api_url=server.url, deployment_id=DEPLOYMENT, token=TOKEN,
                                              poll_interval=0.02, timeout=600))
    stage_rows, floor_rows = [], []
    client = boto_client(endpoint)
    transfer = TransferConfig(multipart_threshold=store.config.part_size, multipart_chunksize=store.config.part_size,
                              max_concurrency=store.config.max_concurrency)
    try:
        for ckpt in (m0, m1):
            say(f"(b) {ckpt.name}: publish and hot-load ...")
            t0 = time.perf_counter()
            publisher.submit(ckpt)  # synchronous: spool, encode, upload, ledger
            snap = publisher.published[-1]
            result = loader.hot_load(snap.identity, base_identity=snap.base if snap.kind == "delta" else None)
            total = time.perf_counter() - t0
            stages = loader.get_operation(result.operation_id)["status"]["stageSeconds"]
            swap = stages["load"]
            known = snap.encode_seconds + snap.upload_seconds + stages["fetch"] + stages["apply"] + swap
            stage_rows.append([
                snap.kind, f"{snap.stored_bytes / MiB:.1f}", f"{100 * snap.stored_bytes / snap.raw_bytes:.1f}%",
                f"{snap.encode_seconds:.2f}", f"{snap.upload_seconds:.2f}", f"{stages['fetch']:.2f}",
                f"{stages['apply']:.2f}", f"{swap:.2f}", f"{total - known:.2f}", f"**{total:.2f}**",
            ])

            # the I/O floor of the same bytes: the snapshot's files, raw
            say(f"(b) {ckpt.name}: I/O floor of the same bytes ...")
            here = data / "floor" / snap.kind
            here.mkdir(parents=True)
            keys = [f"{prefix}/{k}" for k in store.list(f"{snap.identity}/")]
            get = timed(lambda: [client.download_file(bucket, k, str(here / k.rsplit("/", 1)[1]), Config=transfer)
                                 for k in keys], 2)
            put = timed(lambda: [client.upload_file(str(p), bucket, f"floor/{snap.kind}/{p.name}", Config=transfer)
                                 for p in files_of(here)], 2)
            copy = timed(lambda: [shutil.copyfile(p, data / "floor" / f"copy-{p.name}") for p in files_of(here)], 2)
            read = timed(lambda: [subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL, check=True)
                                  for p in files_of(here)], 2)
            floor_rows.append([
                snap.kind, f"{snap.stored_bytes / MiB:.1f}", f"{copy:.2f}", f"{read:.2f}", f"{put:.2f}",
                f"{get:.2f}", f"{snap.upload_seconds / put:.2f}x", f"{stages['fetch'] / get:.2f}x",
                f"**{total / (copy + put + get):.2f}x**",
            ])
            shutil.rmtree(data / "floor")
    finally:
        loader.close()
        server.shutdown()
        publisher.close()
        store.close()
    raw = snap.raw_bytes
    print(f"### (b) Checkpoint saved -> hot-loaded on the reference server: Qwen2 {params / 1e6:.0f}M params, "
          f"{raw / MiB:.0f} MiB bf16, device {server.engine.device}, {os.cpu_count()} cores; "
          f"delta = one Adam step at lr {lr:g} (seconds)\n")
    table(["snapshot", "stored MiB", "of full", "encode", "upload", "download (server fetch)", "apply (reconstruct)",
           "load (build + swap)", "other (spool, API, polls)", "total"], stage_rows)
    print("Stages are single runs; `load` includes building the model from the rebuilt folder (transformers "
          "maps safetensors lazily, so pages are read on first use).\n")
    print("I/O floor of the same bytes (the snapshot's files, best of 2; local reads hit the page cache; raw boto3 "
          "with the store's part size and concurrency):\n")
    table(["snapshot", "MiB", "local copy (read+write)", "cat > /dev/null", "raw S3 PUT", "raw S3 GET",
           "upload / raw PUT", "download / raw GET", "saved -> hot-loaded / (copy + PUT + GET)"], floor_rows)
    print(f"load average (1/5/15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="(a) size of the synthetic checkpoint")
    ap.add_argument("--parts", default="32x8,64x8,64x4,128x4",
                    help="(a) multipart settings to compare with one PUT per file: PART_MIBxIN_FLIGHT,... "
                         "(the store's default: 64x8)")
    ap.add_argument("--repeat", type=int, default=3, help="(a) uploads per mode; the fastest is kept")
    ap.add_argument("--lr", type=float, default=1e-6, help="(b) learning rate of the Adam step of the delta")
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    t0 = time.perf_counter()
    try:
        with s3_endpoint(data) as endpoint:
            client = boto_client(endpoint)
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            client.create_bucket(Bucket=bucket)
            try:
                parts = [tuple(int(x) for x in p.split("x")) for p in args.parts.split(",")]
                upload_throughput(endpoint, bucket, data, args.mib, parts, args.repeat)
                hotload_latency(endpoint, bucket, data, args.lr)
            finally:
                drop_bucket(client, bucket)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    say(f"done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
