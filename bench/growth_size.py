"""How cost grows with the model's size: encode, apply, publish, full and delta hot-load at 0.25-8 GiB.

Each size is a synthetic checkpoint shaped like a decoder (Llama tensor names, hidden 1024-4096 as
the size grows, bf16, sharded at about 2 GiB a file) and the same one Adam-like step later (lr
1e-6). Every stage runs in a process of its own, so its peak RSS (wait4) is its own:

  encode delta   ``posttrain chain encode`` of the new checkpoint against the base
  apply delta    ``posttrain chain apply`` of the delta onto the base's full snapshot
  publish        ``posttrain publish --sync`` of the base (a full snapshot), then of the new one (a
                 delta) to SeaweedFS (multipart): spool, encode, upload, ledger
  hot-load       the reference server's rebuild path (growth_size_rebuild.py: the hot-load
                 service's plan, fetch, view and reconstruct), full (nothing held) and delta (the
                 full version held); the model load that follows is the engine's, not the chain's

GB/s is of the checkpoint's bytes (what the user moves), so sizes compare. Goal: at 8 GiB every
stage at >= 0.9x its 1 GiB throughput, and peak RSS flat in the size (<= 400 MB for the codec).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from growth_common import ROOT, ensure_bucket, loadavg, machine, plot, python, ratio, run_measured, save, table

GiB = 1 << 30
BUCKET = "growth"  # shared with bench/growth_replicas.py: each run writes under a prefix of its own
CODEC_RSS_MIB = 400 * 1e6 / (1 << 20)  # the bound: 400 MB
STAGES = ("encode delta", "apply delta", "publish full", "publish delta", "hot-load full", "hot-load delta")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, nargs="+", default=[0.25, 1, 4, 8], help="checkpoint sizes")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of the Adam-like step")
    p.add_argument("--data", type=Path, default=ROOT / "bench" / ".data" / "growth-size",
                   help="where pairs are built (kept between runs: --gib 8 needs about 50 GiB free)")
    p.add_argument("--keep-pairs", action="store_true", help="keep each size's checkpoints after it ran")


def hidden_for(gib: float) -> int:
    """A decoder's width grows with its size (Llama: 2048 at 1B, 4096 at 7B); scaled down to fit here."""
    return 1024 if gib <= 0.5 else 2048 if gib <= 2 else 3072 if gib <= 5 else 4096


def make_pair(data: Path, gib: float, lr: float) -> tuple[Path, Path]:
    """The base and new checkpoints of one size, built once in a child process (cached by a marker)."""
    folder = data / f"pair-{gib:g}GiB-lr{lr:g}"
    if not (folder / "done").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        print(f"building the {gib:g} GiB pair ...", flush=True)
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import growth_size_pair as g; "
                "g.write_pair(sys.argv[2], sys.argv[3], total_bytes=int(sys.argv[4]), lr=float(sys.argv[5]), "
                "hidden=int(sys.argv[6]), shard_bytes=2 * (1 << 30))")
        subprocess.run([python(), "-c", code, str(ROOT / "bench"), str(folder / "checkpoint-1"),
                        str(folder / "checkpoint-2"), str(int(gib * GiB)), repr(lr), str(hidden_for(gib))],
                       check=True, cwd=ROOT)
        (folder / "done").touch()
    return folder / "checkpoint-1", folder / "checkpoint-2"


def tensor_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def measure_size(gib: float, data: Path, endpoint: str | None, lr: float = 1e-6, keep_pair: bool = True) -> list[dict]:
    """One row per stage for one checkpoint size: seconds, GB/s of the checkpoint's bytes, peak RSS MiB.

    Without an endpoint, the codec's stages only (encode and apply)."""
    base, new = make_pair(data, gib, lr)
    raw = tensor_bytes(new)
    work = data / f"work-{gib:g}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    py = [python(), "-m", "posttrain"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
    rows: list[dict] = []

    def row(stage: str, secs: float, rss: float, stored: int | None = None) -> None:
        rows.append(dict(gib=gib, stage=stage, seconds=secs, gbs=raw / 1e9 / secs, rss_mib=rss,
                         raw_bytes=raw, stored_bytes=stored))
        print(f"  {gib:g} GiB {stage:15} {secs:7.2f} s  {raw / 1e9 / secs:5.2f} GB/s  {rss:6.0f} MiB", flush=True)

    try:
        chain = work / "chain"
        os.sync()
        subprocess.run(py + ["chain", "encode", str(base), "--out", str(chain), "--identity", "base"], check=True,
                       stdout=subprocess.DEVNULL, cwd=ROOT)
        os.sync()
        secs, rss, *_ = run_measured(py + ["chain", "encode", str(new), "--out", str(chain), "--base", str(base),
                                    "--base-identity", "base", "--identity", "new"])
        row("encode delta", secs, rss, sum(p.stat().st_size for p in (chain / "new").iterdir()))
        os.sync()
        secs, rss, *_ = run_measured(py + ["chain", "apply", str(chain), "--version", "new", "--out", str(work / "applied")])
        row("apply delta", secs, rss)
        shutil.rmtree(work / "applied")
        shutil.rmtree(chain)  # disk: an 8 GiB pair, its snapshots and the store's copy must fit together
        if endpoint is None:
            return rows

        bucket_uri = f"s3://{BUCKET}/size-{gib:g}-{uuid.uuid4().hex[:6]}"
        for stage, ckpt, step in (("publish full", base, 1), ("publish delta", new, 2)):
            os.sync()
            secs, rss, *_ = run_measured(py + ["publish", str(ckpt), "--store", bucket_uri, "--run", "growth", "--work-dir",
                                        str(work / "publish"), "--step", str(step), "--sync", "--endpoint-url",
                                        endpoint, "--region", "us-east-1"], env=env)
            row(stage, secs, rss)
        shutil.rmtree(work / "publish")
        for stage in ("hot-load full", "hot-load delta"):
            os.sync()
            secs, rss, _, out = run_measured([python(), str(ROOT / "bench" / "growth_size_rebuild.py"), bucket_uri, endpoint,
                                     str(work / "serve"), stage.split()[1]], env=env, capture=True)
            stages = json.loads(out.strip().splitlines()[-1])
            row(stage, secs, rss, stages["fetched_bytes"])
            rows[-1].update(fetch_s=stages["fetch"], apply_s=stages["apply"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not keep_pair:
            shutil.rmtree(base.parent, ignore_errors=True)
    return rows


def verdicts(rows: list[dict], bound_mib: float = CODEC_RSS_MIB) -> list[list[object]]:
    """Per stage: throughput at the largest size / at 1 GiB (goal >= 0.9) and the largest peak RSS."""
    sizes = sorted({r["gib"] for r in rows})
    ref = 1.0 if 1.0 in sizes else sizes[0]
    out = []
    for stage in STAGES:
        by = {r["gib"]: r for r in rows if r["stage"] == stage}
        if not by:
            continue
        top = max(by)
        keep = ratio(by[top]["gbs"], by[ref]["gbs"])
        peak = max(r["rss_mib"] for r in by.values())
        codec = stage in ("encode delta", "apply delta")
        ok = keep >= 0.9 and (not codec or peak <= bound_mib)
        out.append([stage, f"{by[ref]['gbs']:.2f}", f"{by[top]['gbs']:.2f}", f"{keep:.2f}x",
                    f"{min(r['rss_mib'] for r in by.values()):.0f}-{peak:.0f}", "met" if ok else "NOT met"])
    return out


def main(args: argparse.Namespace) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from publish_hotload import boto_client, s3_endpoint

    print(machine(), flush=True)
    rows: list[dict] = []
    args.data.mkdir(parents=True, exist_ok=True)
    with s3_endpoint(args.data) as endpoint:
        ensure_bucket(boto_client(endpoint), BUCKET)
        for gib in args.gib:
            rows += measure_size(gib, args.data, endpoint, args.lr, keep_pair=args.keep_pairs)
    print()
    table(f"Model size ({machine()})", ["GiB", "hidden", "stage", "seconds", "GB/s", "peak RSS MiB", "fetch s", "apply s"],
          [[f"{r['gib']:g}", hidden_for(r["gib"]), r["stage"], r["seconds"], r["gbs"], f"{r['rss_mib']:.0f}",
            r.get("fetch_s", "-"), r.get("apply_s", "-")] for r in rows])
    print()
    ref = 1.0 if 1.0 in args.gib else min(args.gib)
    table(f"Throughput at {max(args.gib):g} GiB against {ref:g} GiB (goal >= 0.9x; codec peak RSS <= 400 MB)",
          ["stage", f"GB/s at {ref:g} GiB", f"GB/s at {max(args.gib):g} GiB", "ratio", "peak RSS MiB", "goal"],
          verdicts(rows))
    sizes = sorted(args.gib)
    plot("size-throughput", "Throughput against checkpoint size", "checkpoint GiB",
         {s: (sizes, [next(r["gbs"] for r in rows if r["gib"] == g and r["stage"] == s) for g in sizes])
          for s in STAGES}, "GB/s of the checkpoint", logx=True)
    plot("size-rss", "Peak RSS against checkpoint size", "checkpoint GiB",
         {s: (sizes, [next(r["rss_mib"] for r in rows if r["gib"] == g and r["stage"] == s) for g in sizes])
          for s in STAGES}, "peak RSS MiB", logx=True)
    save("size", {"rows": rows, "load_after": loadavg(), "finite": all(math.isfinite(r["gbs"]) for r in rows)})
