"""Benchmark: the cost of reading weights back by digest (issue 34) per switch, against the switch itself.

(a) Hashing rate, one process, on tensors of realistic sizes: ``weight_digest.digest`` (xxh3-128 of
the bytes), the finite check from a sum, ``describe`` (both: what vLLM's readback extension computes
for every tensor, and the reference engine's ``read_held``), and ``isfinite(t).all()`` (the check
``describe`` made before: it computes ``(t == t) * (t.abs() != inf)``, a copy of the tensor and three
masks). Median of 5; "allocates" is what torch allocates meanwhile (its profiler).

(b) vLLM (CPU build, ``$VLLM_VENV``, started by ``VLLMProcess`` with the gateway's defaults: the
readback extension loaded): alternating switches between two checkpoints as the gateway makes them
(pause, reload, resume) with the loader's digests (``client.reload``: ``posttrain_reload``) and
without (``POST /collective_rpc reload_weights``, then ``/reset_prefix_cache``), and what the gateway
reads back after one: ``read_held`` of the comparable parameters, ``consumed_expected`` and
``held_expected`` (the checkpoints carry ``posttrain.checksums.json`` with tensor digests, as every
snapshot the gateway rebuilds does; "hashed here" is ``consumed_expected`` on the folder without it).

(c) The reference engine: ``load_served`` of the next checkpoint beside the served one, against
``read_back`` (a digest and finite check of every parameter, compared with the folder's) and
``check_held`` (what its monitor does at every probe).

(d) A 7B model, extrapolated from the measured rates.

Models: the tiny untied Qwen2 vLLM runs (tests' ``vllm_model``: hidden 128, head_dim 32), and a
Qwen2 of ``--gib`` GiB (hidden 1024, head_dim 64, untied, the tiny tokenizer), built locally from
a config; two of each (seeds 0 and 1). Prints markdown tables; asserts nothing.

    VLLM_VENV=... .venv/bin/python bench/weight_readback.py [--quick] [--gib 1] [--dtype float32]
        [--engine-dtype float32] [--repeat 5] [--start-timeout 600]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench.publish_hotload import say, table  # noqa: E402
from bench.vllm_hotload import status_kib, vllm_version  # noqa: E402

MiB, GB = 1 << 20, 1e9
HIDDEN, INTER, HEADS, KV_HEADS = 1024, 4096, 16, 4  # the --gib model: Qwen2 shapes, head_dim 64
# Llama-2-7B's shapes (untied); the held parameters for two vocabularies (Llama-2's, Qwen2's)
L7_HIDDEN, L7_INTER, L7_LAYERS, L7_VOCABS = 4096, 11008, 32, (32000, 152064)


# ---------------------------------------------------------------------- (a) hashing rate
def median_of(repeat: int, fn: Callable[[], object]) -> float:
    """Median seconds of ``repeat`` calls (not the best: on a loaded machine the best is a lucky one)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def allocated_mib(fn: Callable[[], object]) -> float:
    """MiB that torch allocates while ``fn`` runs (torch's profiler: every allocation, freed or not)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.key_averages()) / MiB


def hash_rates(sizes_mib: list[int], repeat: int) -> dict[tuple[str, str], float]:
    """Print the hashing table; GB/s per (dtype, operation) at the largest size."""
    import torch

    from posttrain.serve.weight_digest import describe, digest

    def isfinite(t: torch.Tensor) -> bool:
        return bool(torch.isfinite(t).all())

    ops = {"digest": digest, "sum": lambda t: bool(torch.isfinite(t.sum())), "describe": describe,
           "isfinite": isfinite}
    rows, rates = [], {}
    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)
        for mib in sizes_mib:
            n = mib * MiB // dt.itemsize
            t = torch.randn(n // 4096, 4096, generator=torch.Generator().manual_seed(0)).to(dt)
            got = {op: t.nbytes / median_of(repeat, lambda f=f, t=t: f(t)) / GB for op, f in ops.items()}
            extra = [allocated_mib(lambda f=f, t=t: f(t)) for f in (describe, isfinite)]
            rates.update({(dtype, op): r for op, r in got.items()})
            rows.append([dtype, str(mib), *(f"{got[op]:.2f}" for op in ops), " / ".join(f"{x:.0f}" for x in extra)])
    print(f"### Hashing rate, one process (GB/s, median of {repeat}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)\n")
    table(["dtype", "tensor MiB", "`digest`", "finite from `t.sum()`", "`describe` (digest + finite from the sum)",
           "`isfinite(t).all()`", "allocates MiB: `describe` / `isfinite`"], rows)
    return rates


# ---------------------------------------------------------------------- models
def build_pair(out: Path, gib: float | None, dtype: str) -> tuple[list[Path], dict]:
    """Two checkpoints (seeds 0 and 1) with tensor digests in posttrain.checksums.json; ``gib`` None: the
    tiny model vLLM runs. Returns the folders and facts (bytes, params, layers, consumed_expected
    without the checksums file)."""
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.chain.checkpoint import Checkpoint
    from posttrain.chain.manifest import write_manifest
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
    from posttrain.serve.weight_digest import consumed_expected

    transformers.utils.logging.disable_progress_bar()
    folders, facts = [], {}
    tok = build_tiny_tokenizer(512)
    for seed in (0, 1):
        folder = out / f"ckpt-{seed}"
        if gib is None:  # tests/support/vllm.py's vllm_model, untied (vLLM reloads only an untied one)
            build_tiny_model(folder, seed=seed, dtype=dtype, hidden_size=128, num_heads=4, num_kv_heads=2,
                             tie_word_embeddings=False)
            layers = 2
        else:
            vocab, kv = len(tok), HIDDEN // HEADS * KV_HEADS
            per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 2 * kv + HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
            itemsize = getattr(torch, dtype).itemsize
            layers = max(1, round((gib * (1 << 30) / itemsize - 2 * vocab * HIDDEN - HIDDEN) / per_layer))
            config = Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER,
                                 num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                 max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            del model
        t0 = time.perf_counter()
        expected = consumed_expected(folder)  # no checksums file yet: every tensor hashed from the file
        facts["hashed_here"] = time.perf_counter() - t0
        write_manifest(folder, {name: e.digest for name, e in expected.items()})
        folders.append(folder)
    ckpt = Checkpoint.open(folders[0])
    facts.update(bytes=ckpt.total_bytes, params=sum(math.prod(t.shape) for t in ckpt.tensors.values()),
                 layers=layers, tensors=len(ckpt.tensors))
    return folders, facts


def label(facts: dict, dtype: str) -> str:
    return f"{facts['params'] / 1e6:.1f}M params, {facts['layers']} layers, {facts['bytes'] / MiB:.0f} MiB {dtype}"


# ---------------------------------------------------------------------- (b) vLLM
def vllm_switches(folders: list[Path], engine_dtype: str, repeat: int, log: Path, start_timeout: float) -> dict:
    """Median seconds of each step over ``repeat`` switches of each kind, alternated, and of the difference
    within each pair (a switch with the loader's digests, then one without)."""
    from posttrain.serve.vllm.process import VLLMProcess, VLLMProcessConfig
    from posttrain.serve.weight_digest import comparable, compare, consumed_expected, held_expected

    process = VLLMProcess(VLLMProcessConfig(served_model_name="bench", dtype=engine_dtype, log_file=log,
                                            start_timeout_s=start_timeout))
    t0 = time.perf_counter()
    process.start(folders[0])
    times: dict[str, list[float]] = {k: [] for k in ("plain", "hashed", "held", "consumed", "held_exp", "compare")}
    try:
        client = process.client(timeout=600)
        start = time.perf_counter() - t0
        t0 = time.perf_counter()
        names = comparable(client.read_layout([]), folders[0])
        layout = time.perf_counter() - t0
        target = 1
        for _ in range(repeat):
            for kind in ("hashed", "plain"):
                folder = folders[target]
                target = 1 - target
                t0 = time.perf_counter()
                client.pause()
                try:
                    if kind == "hashed":
                        consumed = client.reload(folder)
                    else:
                        client._json("POST", "/collective_rpc", json={"method": "reload_weights",
                                                                      "kwargs": {"weights_path": str(folder)}})
                        client._json("POST", "/reset_prefix_cache")
                finally:
                    client.resume()
                times[kind].append(time.perf_counter() - t0)
                if kind == "plain":
                    continue
                t0 = time.perf_counter()
                report = client.read_held(names)
                times["held"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                want_consumed = consumed_expected(folder)
                times["consumed"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                want_held = held_expected(folder, names, report.dtype)
                times["held_exp"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                verdicts = [compare(want_consumed, consumed, what="consumed", version=folder.name, exhaustive=True),
                            compare(want_held, report.tensors, what="held", version=folder.name)]
                times["compare"].append(time.perf_counter() - t0)
                for v in verdicts:
                    if not v:
                        say(f"readback did not match (a bug to look at): {v.reason}")
        client.close()
    finally:
        process.stop()
    out = {k: statistics.median(v) for k, v in times.items()}
    # each hashed switch against the plain one right after it: the load on the machine drifts less within a pair
    out["delta"] = statistics.median(h - p for h, p in zip(times["hashed"], times["plain"], strict=True))
    out.update(start=start, layout=layout, held_names=len(names), dtype=report.dtype,
               held_bytes=sum(math.prod(t.shape) for t in report.tensors.values()))
    return out


# ---------------------------------------------------------------------- (c) the reference engine
def reference_loads(folders: list[Path], repeat: int) -> dict:
    import torch

    from posttrain.serve.model_slot import check_held, load_served, read_back, read_held

    cpu = torch.device("cpu")
    served = read_back(load_served(folders[0], cpu, identity=folders[0].name), folders[0].name)
    times: dict[str, list[float]] = {"load": [], "read_back": [], "again": [], "check_held": []}
    for i in range(repeat):
        folder = folders[(i + 1) % 2]
        t0 = time.perf_counter()
        new = load_served(folder, cpu, like=served, identity=folder.name)
        times["load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        new = read_back(new, folder.name)
        times["read_back"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        read_held(new.model)  # read_back's own pass over the parameters, again: the rest is the expected digests
        times["again"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        why = check_held(new, folder.name)
        times["check_held"].append(time.perf_counter() - t0)
        if why is not None:
            say(f"check_held did not match (a bug to look at): {why}")
        served = new
    return {k: statistics.median(v) for k, v in times.items()}


# ---------------------------------------------------------------------- the run
def llama7b_bytes(itemsize: int, vocab: int) -> tuple[int, int]:
    """(every parameter, the held-comparable ones: embeddings, LM head, norms) of a Llama-2-7B shape."""
    per_layer = 4 * L7_HIDDEN * L7_HIDDEN + 3 * L7_HIDDEN * L7_INTER + 2 * L7_HIDDEN
    held = 2 * vocab * L7_HIDDEN + (2 * L7_LAYERS + 1) * L7_HIDDEN
    every = L7_LAYERS * (per_layer - 2 * L7_HIDDEN) + held  # the layers' norms are counted in held
    return every * itemsize, held * itemsize


def run(data: Path, args: argparse.Namespace) -> None:
    say("hashing rates ...")
    rates = hash_rates([64, 256], 5)
    models = [("tiny", None)] + ([] if args.quick else [(f"{args.gib:g} GiB", args.gib)])
    vrows, rrows, measured = [], [], {}
    for name, gib in models:
        say(f"{name}: building two checkpoints ({args.dtype}) ...")
        folders, facts = build_pair(data / name.replace(" ", ""), gib, args.dtype)
        say(f"{name}: {label(facts, args.dtype)}; vLLM ({args.engine_dtype}) switches ...")
        v = vllm_switches(folders, args.engine_dtype, args.repeat, data / f"vllm-{gib}.log",
                          args.start_timeout)
        loader = v["delta"]
        readback = loader + v["held"] + v["consumed"] + v["held_exp"] + v["compare"]
        total = v["plain"] + readback
        measured[name] = (facts["bytes"], loader)
        f3 = "{:.3f}".format
        vrows.append([f"{name}: {label(facts, args.dtype)}", v["dtype"], f3(v["plain"]), f3(v["hashed"]),
                      f"{f3(loader)} ({facts['bytes'] / max(loader, 1e-9) / GB:.2f} GB/s)",
                      f"{f3(v['held'])} ({v['held_names']} params, {v['held_bytes'] / 1e6:.1f}M values)",
                      f"{f3(v['consumed'])} / {f3(facts['hashed_here'])}", f3(v["held_exp"]), f3(readback),
                      f3(total), f"**{100 * readback / total:.0f}%**"])
        say(f"{name}: vLLM started in {v['start']:.1f} s; layout read in {v['layout']:.3f} s; the reference engine ...")
        r = reference_loads(folders, args.repeat)
        rrows.append([f"{name}: {label(facts, args.dtype)}", f3(r["load"]), f3(r["read_back"]), f3(r["again"]),
                      f3(r["check_held"]),
                      f"**{100 * r['read_back'] / (r['load'] + r['read_back']):.0f}%**"])
        shutil.rmtree(folders[0].parent, ignore_errors=True)

    print(f"### vLLM: an in-place switch with and without the readback (seconds, median of {args.repeat} each, "
          f"alternated; {vllm_version()} CPU build, --dtype {args.engine_dtype})\n")
    table(["checkpoint", "held dtype", "switch, no readback", "switch, loader digests", "loader hashing (Δ of pairs)",
           "`read_held`", "`consumed_expected` (checksums file / hashed here)", "`held_expected`",
           "readback", "hot-load (switch with no readback + readback)", "readback / hot-load"], vrows)
    print("A switch is pause + reload + /reset_prefix_cache + resume. readback = loader hashing + `read_held` + "
          "both expected digests (from the checksums file) + `compare`; the gateway's hot-load also downloads "
          "and rebuilds the snapshot, which this leaves out.\n")
    print(f"### The reference engine: loading the next checkpoint against reading it back (seconds, median of "
          f"{args.repeat})\n")
    table(["checkpoint", "`load_served` (beside the served one)", "`read_back` (every parameter)",
           "its `read_held` alone (run again)", "`check_held` (each probe)", "read_back / (load + read_back)"], rrows)

    big = max(measured.values()) if len(measured) > 1 else None  # the tiny model's Δ is mostly RPC noise
    in_vllm = big[0] / max(big[1], 1e-9) / GB if big else math.nan
    rows = []

    def seconds(nbytes: int, dtype: str) -> list[str]:
        before = 1 / (1 / rates[(dtype, "digest")] + 1 / rates[(dtype, "isfinite")])
        return [f"{nbytes / GB / rate:.1f}" for rate in (rates[(dtype, "describe")], rates[(dtype, "digest")], before)]

    for dtype, itemsize in (("bfloat16", 2), ("float32", 4)):
        every, _ = llama7b_bytes(itemsize, L7_VOCABS[0])
        rows.append([f"loader digests per switch: every tensor ({dtype} checkpoint)", f"{every / GB:.1f}",
                     *seconds(every, dtype), f"{every / GB / in_vllm:.1f}" if big and dtype == args.dtype else "—"])
    for vocab in L7_VOCABS:
        _, held = llama7b_bytes(2, vocab)
        rows.append([f"`read_held` per probe: embeddings + LM head + norms, vocab {vocab} (bfloat16)",
                     f"{held / GB:.2f}", *seconds(held, "bfloat16"), "—"])
    print("### A 7B model (Llama-2-7B's shapes, untied), from the rates above (seconds)\n")
    table(["readback", "GB", "at `describe`'s rate", "at `digest`'s rate (no finite check)",
           "with `isfinite(t).all()` (as before)", f"at the rate measured in vLLM ({in_vllm:.2f} GB/s, {args.dtype})" if big
           else "at the rate measured in vLLM (needs the larger model: no --quick)"],
          rows)
    print(f"Machine: {os.cpu_count()} cores shared with other work (loaded while measured); peak RSS of this "
          f"process {status_kib(os.getpid(), 'VmHWM') / 1024:.0f} MiB.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model only")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the larger checkpoint in GiB")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the checkpoints' dtype")
    ap.add_argument("--engine-dtype", choices=["auto", "float32", "bfloat16"], default=None,
                    help="vLLM's --dtype (default: the checkpoints'; auto: the gateway's default)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds for vLLM to start and answer")
    ap.add_argument("--repeat", type=int, default=5, help="switches of each kind, reference loads")
    args = ap.parse_args()
    args.engine_dtype = args.engine_dtype or args.dtype
    data = Path(tempfile.mkdtemp(prefix="posttrain-bench-readback-"))
    t0 = time.perf_counter()
    try:
        run(data, args)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    say(f"done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
