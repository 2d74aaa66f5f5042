"""Benchmark: posttrain's streamed LoRA merge against peft's merge_and_unload(), each in its own process.

Builds (once, cached under --data) a Qwen2-shaped base of at least --mb MB of BF16 weights in
~200 MB shards and a rank-16 adapter on every linear layer of it (random A and B), then times
``posttrain.lora.merge.merge_adapter`` and peft (``from_pretrained`` + ``PeftModel.from_pretrained``
+ ``merge_and_unload`` + ``save_pretrained``) in fresh processes, prints wall time and peak RSS
(``wait4``'s ru_maxrss: Python and torch's import included, ~220 MB here) and checks that both
outputs are the same bytes, tensor by tensor. The acceptance bound for the streamed merge is
0.25 x base + 300 MB.

    .venv/bin/python bench/lora_merge.py [--mb 600] [--data bench/.data]
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
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a command run in its own process. The peak is the child's
    own VmHWM (printed by it last): ru_maxrss of a child keeps the high-water mark of the process
    it was forked from."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                               "TRANSFORMERS_VERBOSITY": "error"})
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return secs, float(proc.stdout.split()[-1]) / 1024


def vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def weights_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 1e6


def make_inputs(data: Path, mb: int) -> tuple[Path, Path]:
    """A BF16 base of >= ``mb`` MB and a rank-16 adapter on all its linear layers (cached)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base, adapter = data / f"lora-base-{mb}MB", data / f"lora-adapter-{mb}MB"
    if base.exists() and adapter.exists():
        return base, adapter
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(adapter, ignore_errors=True)
    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter)  # bytes in BF16 (k, v as wide as q: no GQA)
    layers = max(1, -(-(mb * 10**6 - 2 * vocab * hidden) // per_layer))
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=True,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(base, max_shard_size="200MB")
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS,
                                                  init_lora_weights=False))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    peft_model.save_pretrained(adapter)
    return base, adapter


def child_streamed(base: str, adapter: str, out: str) -> None:
    from posttrain.lora.merge import merge_adapter

    merge_adapter(adapter, base, out)


def child_peft(base: str, adapter: str, out: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, max_shard_size="200MB")


def same_bytes(a: Path, b: Path) -> tuple[int, int]:
    """(tensors compared, tensors differing) between two model folders, one tensor at a time."""
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        found = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as st:
                found.update(dict.fromkeys(st.keys(), f))
        return found

    wa, wb = where(a), where(b)
    differ = 0
    for name in sorted(set(wa) & set(wb)):
        with safe_open(str(wa[name]), framework="pt") as x, safe_open(str(wb[name]), framework="pt") as y:
            ta, tb = x.get_tensor(name), y.get_tensor(name)
            differ += not (ta.dtype == tb.dtype and ta.shape == tb.shape
                           and ta.view(-1).view(_int(ta)).equal(tb.view(-1).view(_int(tb))))
    missing = set(wa) ^ set(wb)
    return len(set(wa) & set(wb)), differ + len(missing)


def _int(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=600, help="base size in MB (BF16 weights)")
    parser.add_argument("--data", type=Path, default=ROOT / "bench" / ".data")
    parser.add_argument("--child", nargs=4, metavar=("KIND", "BASE", "ADAPTER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, base, adapter, out = args.child
        if kind == "inputs":
            make_inputs(Path(base), int(adapter))
        else:
            {"streamed": child_streamed, "peft": child_peft}[kind](base, adapter, out)
        print(vm_hwm_kib())
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base, adapter = args.data / f"lora-base-{args.mb}MB", args.data / f"lora-adapter-{args.mb}MB"
    run([sys.executable, __file__, "--child", "inputs", str(args.data), str(args.mb), "-"])  # cached
    size = weights_mb(base)
    rows = []
    outs = {}
    for kind in ("streamed", "peft"):
        out = args.data / f"merged-{kind}"
        shutil.rmtree(out, ignore_errors=True)
        secs, rss = run([sys.executable, __file__, "--child", kind, str(base), str(adapter), str(out)])
        outs[kind] = out
        rows.append((kind, secs, rss))
    compared, differing = same_bytes(outs["streamed"], outs["peft"])
    bound = 0.25 * size + 300
    print(f"base: {size:.0f} MB BF16 ({len(list(base.glob('*.safetensors')))} shards), adapter: r=16 on "
          f"{', '.join(TARGETS)}; {os.cpu_count()} cores\n")
    print("| merge | wall s | peak RSS MB | RSS / base |")
    print("|---|---:|---:|---:|")
    for kind, secs, rss in rows:
        label = "posttrain streamed (`merge_adapter`)" if kind == "streamed" else "peft `merge_and_unload` + save"
        print(f"| {label} | {secs:.2f} | {rss * 1.048576:.0f} | {rss * 1.048576 / size:.2f} |")
    streamed_mb = rows[0][2] * 1.048576
    print(f"\nbound 0.25 x base + 300 MB = {bound:.0f} MB: {'PASS' if streamed_mb <= bound else 'FAIL'}; "
          f"outputs: {compared} tensors compared, {differing} differ "
          f"({'bit-identical' if differing == 0 else 'NOT identical'})")
    print(json.dumps({"base_mb": round(size), "rows": rows, "bound_mb": round(bound), "differing": differing}))
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
