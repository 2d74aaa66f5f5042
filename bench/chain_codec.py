"""Benchmark: posttrain's chain codec against the naive producer, in the same run.

Builds a realistic checkpoint pair (>= 1 GiB of bf16 weights plus small fp32/int64 tensors, one
Adam-like step at each learning rate), then runs every encode and apply in a fresh process and
prints wall time, throughput, peak RSS and delta size as a share of the full checkpoint.

    .venv/bin/python bench/chain_codec.py [--gib 1.0] [--lr 1e-6 1e-5] [--data bench/.data]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from posttrain.testing.synthetic import dir_size  # noqa: E402


def run(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a command run in its own process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()}")
    return secs, usage.ru_maxrss / 1024


def make_pair(data: Path, gib: float, lr: float) -> tuple[Path, Path]:
    d = data / f"pair-{gib:g}GiB-lr{lr:g}"
    if not (d / "done").exists():
        shutil.rmtree(d, ignore_errors=True)
        print(f"building {d.name} ...", flush=True)
        # in a child process, so that this process stays small: a child's peak RSS counts the
        # pages it inherited at fork
        code = ("import sys; from posttrain.testing.synthetic import adam_like_pair; "
                "adam_like_pair(sys.argv[1], sys.argv[2], total_bytes=int(sys.argv[3]), lr=float(sys.argv[4]), seed=1)")
        subprocess.run([sys.executable, "-c", code, str(d / "base"), str(d / "new"), str(int(gib * (1 << 30))),
                        repr(lr)], check=True, cwd=ROOT)
        (d / "done").touch()
    return d / "base", d / "new"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / ".data")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the fastest is kept")
    args = ap.parse_args()
    py = sys.executable
    rows = []
    for lr in args.lr:
        base, new = make_pair(args.data, args.gib, lr)
        raw = sum(p.stat().st_size for p in new.glob("*.safetensors"))
        work = args.data / "work"

        def measure(kind: str, make_cmd) -> tuple[float, float, Path]:
            best = (float("inf"), 0.0)
            for _ in range(args.repeat):
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                secs, rss = run(make_cmd(work))
                best = min(best, (secs, rss))
            out = args.data / f"out-{kind}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.move(work, out)
            return best[0], best[1], out

        # posttrain: a full snapshot of the base, then the delta, both into one chain
        chain = args.data / "chain"
        shutil.rmtree(chain, ignore_errors=True)
        subprocess.run([py, "-m", "posttrain", "chain", "encode", str(base), "--out", str(chain),
                        "--identity", "base"], check=True, stdout=subprocess.DEVNULL)
        pt_s, pt_rss, pt_out = measure("posttrain-encode", lambda w: [
            py, "-m", "posttrain", "chain", "encode", str(new), "--out", str(w / "chain"),
            "--base", str(base), "--base-identity", "base", "--identity", "new"])
        delta_dir = pt_out / "chain" / "new"
        shutil.rmtree(chain / "new", ignore_errors=True)
        shutil.copytree(delta_dir, chain / "new")
        nv_s, nv_rss, nv_out = measure("naive-encode", lambda w: [
            py, str(ROOT / "bench" / "naive_codec.py"), "encode", str(new), str(base), str(w / "delta")])
        pa_s, pa_rss, _ = measure("posttrain-apply", lambda w: [
            py, "-m", "posttrain", "chain", "apply", str(chain), "--version", "new", "--out", str(w / "rec")])
        na_s, na_rss, _ = measure("naive-apply", lambda w: [
            py, str(ROOT / "bench" / "naive_codec.py"), "apply", str(base), str(nv_out / "delta"), str(w / "rec")])
        pt_share = dir_size(delta_dir) / raw
        nv_share = dir_size(nv_out / "delta") / raw
        gbs = raw / 1e9
        rows += [
            (lr, "encode", "naive", nv_s, gbs / nv_s, nv_rss, nv_share, 1.0),
            (lr, "encode", "posttrain", pt_s, gbs / pt_s, pt_rss, pt_share, nv_s / pt_s),
            (lr, "apply", "naive", na_s, gbs / na_s, na_rss, None, 1.0),
            (lr, "apply", "posttrain", pa_s, gbs / pa_s, pa_rss, None, na_s / pa_s),
        ]
    print()
    print(f"checkpoint: {raw / (1 << 30):.2f} GiB of tensors, {os.cpu_count()} cores; "
          f"RSS budget 0.25 x checkpoint + 300 MB = {0.25 * raw / (1 << 20) + 300:.0f} MiB")
    hdr = f"| {'lr':>6} | {'op':6} | {'codec':9} | {'seconds':>7} | {'GB/s':>5} | {'peak RSS MiB':>12} | {'delta % of full':>15} | {'speedup':>7} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for lr, op, codec, s, tp, rss, share, sp in rows:
        sh = f"{100 * share:.2f}" if share is not None else "-"
        print(f"| {lr:>6g} | {op:6} | {codec:9} | {s:7.2f} | {tp:5.2f} | {rss:12.0f} | {sh:>15} | {sp:6.2f}x |")
    print(json.dumps({"rows": rows}), file=sys.stderr)


if __name__ == "__main__":
    main()
