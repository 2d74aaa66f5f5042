"""Benchmark: posttrain's chain codec against Axolotl 0.21's encoder and the naive producer, in one run.

Builds a realistic checkpoint pair (>= 1 GiB of bf16 weights plus small fp32/int64 tensors, one
Adam-like step at each learning rate), then runs every encode and apply as a whole process,
alternating the codecs round by round, and prints the median wall time, peak RSS, delta size as
a share of the full checkpoint, and ratios against Axolotl's encoder measured in the same run.
Apply's floor is copying the folder it rebuilds: ``cp -r`` of it, and ``cp -r`` then ``sync`` of
each file (apply fsyncs its output), in the same alternation.
Axolotl's wheel is fetched with pip (``--no-deps``) into the data folder and its encoder module
is imported from it (``bench/axolotl_encoder.py``); without the wheel its rows are skipped.
The decompressed deltas of all encoders are compared byte for byte.

    .venv/bin/python bench/chain_codec.py [--gib 1.0] [--lr 1e-6 1e-5] [--repeat 3] [--data bench/.data]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import axolotl_encoder  # noqa: E402
from growth_common import run_measured  # noqa: E402

from posttrain.chain.safetensors_io import read_header  # noqa: E402
from posttrain.testing.synthetic import dir_size  # noqa: E402


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


def delta_frames(delta_dir: Path) -> dict[str, tuple[str, Path, int, int]]:
    """tensor -> (checksum, shard, offset, length) of each frame of a delta folder."""
    index = json.loads((delta_dir / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        header = read_header(delta_dir / fname)
        for name, info in header.tensors.items():
            out[name] = (header.metadata[name], delta_dir / fname, info.offset, info.nbytes)
    return out


def xor_stream(frame: tuple[str, Path, int, int], piece: int = 1 << 20):
    """The decompressed XOR stream of one frame, in pieces: this process must stay small, since a
    child's peak RSS counts the pages it inherited at fork."""
    import zstandard

    _, path, offset, length = frame
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), length, offset)
    with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as r:
        while chunk := r.read(piece):
            yield chunk


def compare_deltas(ref: Path, other: Path) -> str:
    """Whether two deltas hold the same tensors, checksums and decompressed XOR streams."""
    a, b = delta_frames(ref), delta_frames(other)
    if a.keys() != b.keys():
        return f"tensor sets differ ({len(a)} vs {len(b)})"
    for name in sorted(a):
        if a[name][0] != b[name][0]:
            return f"checksums of {name} differ"
        sa, sb = xor_stream(a[name]), xor_stream(b[name])
        buf_a = buf_b = b""
        while True:
            if not buf_a:
                buf_a = next(sa, b"")
            if not buf_b:
                buf_b = next(sb, b"")
            if not buf_a or not buf_b:
                if buf_a or buf_b:
                    return f"XOR stream of {name} has another length"
                break
            n = min(len(buf_a), len(buf_b))
            if buf_a[:n] != buf_b[:n]:
                return f"XOR stream of {name} differs"
            buf_a, buf_b = buf_a[n:], buf_b[n:]
    return "identical"


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / ".data")
    ap.add_argument("--repeat", type=int, default=3, help="alternated rounds; the median is kept")
    ap.add_argument("--no-axolotl", action="store_true", help="do not fetch or run Axolotl's encoder")
    args = ap.parse_args()
    py = sys.executable
    wheel = None if args.no_axolotl else axolotl_encoder.fetch(args.data / "axolotl")
    if not isinstance(wheel, Path):
        print(f"Axolotl 0.21 encoder skipped: {'--no-axolotl' if args.no_axolotl else wheel}")
        wheel = None
    try:
        import zlib_ng  # noqa: F401
    except ImportError:
        print("note: zlib-ng is not installed here; posttrain's adler32 falls back to zlib (slower)")
    rows, checks = [], []
    for lr in args.lr:
        base, new = make_pair(args.data, args.gib, lr)
        raw = sum(p.stat().st_size for p in new.glob("*.safetensors"))
        # posttrain's apply reads a chain: a full snapshot of the base, then the delta
        chain = args.data / "chain"
        shutil.rmtree(chain, ignore_errors=True)
        subprocess.run([py, "-m", "posttrain", "chain", "encode", str(base), "--out", str(chain),
                        "--identity", "base"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([py, "-m", "posttrain", "chain", "encode", str(new), "--out", str(chain), "--base",
                        str(base), "--base-identity", "base", "--identity", "new"], check=True,
                       stdout=subprocess.DEVNULL)
        # what apply writes, rebuilt once: the floor of apply is copying these bytes (cp), and
        # copying them durably (cp, then fsync of each file, as apply fsyncs its output)
        rebuilt = args.data / "rebuilt"
        shutil.rmtree(rebuilt, ignore_errors=True)
        subprocess.run([py, "-m", "posttrain", "chain", "apply", str(chain), "--version", "new", "--out",
                        str(rebuilt)], check=True, stdout=subprocess.DEVNULL)
        naive_delta = args.data / "naive-delta"
        shutil.rmtree(naive_delta, ignore_errors=True)
        subprocess.run([py, str(ROOT / "bench" / "naive_codec.py"), "encode", str(new), str(base), str(naive_delta)],
                       check=True)
        cmds = {
            ("encode", "posttrain"): lambda w: [py, "-m", "posttrain", "chain", "encode", str(new), "--out",
                                                str(w / "chain"), "--base", str(base), "--base-identity", "base",
                                                "--identity", "new"],
            ("encode", "naive"): lambda w: [py, str(ROOT / "bench" / "naive_codec.py"), "encode", str(new),
                                            str(base), str(w / "delta")],
            ("apply", "posttrain"): lambda w: [py, "-m", "posttrain", "chain", "apply", str(chain), "--version",
                                               "new", "--out", str(w / "rec")],
            ("apply", "naive"): lambda w: [py, str(ROOT / "bench" / "naive_codec.py"), "apply", str(base),
                                           str(naive_delta), str(w / "rec")],
            ("apply", "posttrain --no-fsync"): lambda w: [py, "-m", "posttrain", "chain", "apply", str(chain),
                                                          "--version", "new", "--out", str(w / "rec"), "--no-fsync"],
            ("apply", "cp"): lambda w: ["cp", "-r", str(rebuilt), str(w / "copy")],
            ("apply", "cp+fsync"): lambda w: ["sh", "-c", 'cp -r "$0" "$1" && sync "$1"/*', str(rebuilt),
                                              str(w / "copy")],
        }
        if wheel is not None:
            cmds[("encode", "axolotl")] = lambda w: [py, str(ROOT / "bench" / "axolotl_encoder.py"), str(wheel),
                                                     str(new), str(base), str(w / "delta")]
        times: dict[tuple[str, str], list[float]] = {k: [] for k in cmds}
        rss: dict[tuple[str, str], list[float]] = {k: [] for k in cmds}
        cpu: dict[tuple[str, str], list[float]] = {k: [] for k in cmds}
        load_before = loadavg()
        order = list(cmds.items())
        for i in range(args.repeat):
            # alternated: one run of each per round, each round starting one further along, so that no
            # command always follows the same one (on a VM, the run after one that freed 2 GiB pays
            # for getting memory back: cp's times swung 0.3-2.2 s when it always followed naive's apply)
            for key, make_cmd in order[i % len(order):] + order[:i % len(order)]:
                work = args.data / f"work-{key[0]}-{key[1]}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                os.sync()  # start each run with no writeback left over from the one before
                secs, peak, cpu_s, _ = run_measured(make_cmd(work))
                times[key].append(secs)
                rss[key].append(peak)
                cpu[key].append(cpu_s)
        load_after = loadavg()
        pt_delta = args.data / "work-encode-posttrain" / "chain" / "new"
        shares = {"posttrain": dir_size(pt_delta) / raw, "naive": dir_size(args.data / "work-encode-naive" / "delta") / raw}
        checks.append((lr, "naive", compare_deltas(args.data / "work-encode-naive" / "delta", pt_delta)))
        if wheel is not None:
            ax_delta = args.data / "work-encode-axolotl" / "delta"
            shares["axolotl"] = dir_size(ax_delta) / raw
            checks.append((lr, "axolotl", compare_deltas(ax_delta, pt_delta)))
        med = {k: statistics.median(v) for k, v in times.items()}
        ax = med.get(("encode", "axolotl"))
        for op, codec in [("encode", "axolotl"), ("encode", "naive"), ("encode", "posttrain"), ("apply", "naive"),
                          ("apply", "posttrain"), ("apply", "posttrain --no-fsync"), ("apply", "cp"),
                          ("apply", "cp+fsync")]:
            if (op, codec) not in med:
                continue
            s = med[(op, codec)]
            naive = med[(op, "naive")]
            rows.append(dict(lr=lr, op=op, codec=codec, seconds=s, runs=times[(op, codec)], gbs=raw / 1e9 / s,
                             cpu=statistics.median(cpu[(op, codec)]),
                             rss=max(rss[(op, codec)]), share=shares.get(codec) if op == "encode" else None,
                             vs_naive=naive / s, vs_axolotl=ax / s if ax else None,
                             vs_cp=s / med[("apply", "cp")] if op == "apply" else None,
                             vs_cp_fsync=s / med[("apply", "cp+fsync")] if op == "apply" else None,
                             vs_encode=med[("encode", "posttrain")] / s if (op, codec) == ("apply", "posttrain") else None,
                             load=f"{load_before} -> {load_after}"))
    print()
    print(f"checkpoint: {raw / (1 << 30):.2f} GiB of tensors, {os.cpu_count()} cores; medians of {args.repeat} "
          f"alternated whole-process runs (CPU s: user + system, median); RSS budget 0.25 x checkpoint + 300 MiB = {0.25 * raw / (1 << 20) + 300:.0f} MiB")
    runs_w = max(17, 5 * args.repeat - 1)  # "0.00" per run, space-separated
    hdr = (f"| {'lr':>6} | {'op':6} | {'codec':20} | {'median s':>8} | {'runs s':>{runs_w}} | {'GB/s':>5} | "
           f"{'CPU s':>5} | {'peak RSS MiB':>12} | {'delta % of full':>15} | {'x naive':>7} | {'x Axolotl enc':>13} | "
           f"{'time / cp':>9} | {'time / cp+fsync':>15} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        sh = f"{100 * r['share']:.2f}" if r["share"] is not None else "-"
        runs = " ".join(f"{x:.2f}" for x in r["runs"])
        vs_ax = f"{r['vs_axolotl']:.2f}x" if r["vs_axolotl"] else "-"
        vs_cp = f"{r['vs_cp']:.2f}x" if r["vs_cp"] else "-"
        vs_cpf = f"{r['vs_cp_fsync']:.2f}x" if r["vs_cp_fsync"] else "-"
        vs_naive = f"{r['vs_naive']:6.2f}x" if not r["codec"].startswith("cp") else "-"
        print(f"| {r['lr']:>6g} | {r['op']:6} | {r['codec']:20} | {r['seconds']:8.2f} | {runs:>{runs_w}} | {r['gbs']:5.2f} | "
              f"{r['cpu']:5.2f} | {r['rss']:12.0f} | {sh:>15} | {vs_naive:>7} | {vs_ax:>13} | {vs_cp:>9} | {vs_cpf:>15} |")
    for r in rows:
        if r["vs_encode"]:
            scratch = next(x for x in rows if x["lr"] == r["lr"] and x["codec"] == "posttrain --no-fsync")
            print(f"lr {r['lr']:g}: posttrain's apply runs at {r['vs_encode']:.2f}x the speed of its encode "
                  f"(encode time / apply time); it fsyncs its output, and takes {r['vs_cp_fsync']:.2f}x the time "
                  f"of cp + fsync of the rebuilt folder; with --no-fsync {scratch['vs_cp']:.2f}x the time of cp")
    for lr in args.lr:
        print(f"lr {lr:g}: load average (1/5/15 min) {next(r['load'] for r in rows if r['lr'] == lr)}")
    for lr, codec, verdict in checks:
        print(f"lr {lr:g}: posttrain's delta vs {codec}'s, decompressed, with checksums: {verdict}")
    print(json.dumps({"rows": rows, "checks": checks}), file=sys.stderr)
    if any(v != "identical" for _, _, v in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
