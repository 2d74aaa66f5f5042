"""The measurements behind ``posttrain.serve.probe.TOLERANCES``, on the tiny model.

    python bench/probe_tolerance.py

For seeds 0-2 of the tiny model (hidden 64, tied; hidden 128, untied), the probe computed in
float32 (``posttrain.trainer.probe.compute_probe``) against: the same computation again; all four
sequences in one batch; the weights cast to bf16/fp16 and computed there; and those bf16/fp16
weights computed in float32 (another kernel path on the same weights). Prints the max absolute
logprob difference over the 4x8 probe tokens, per model and the max over all.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from posttrain.models.tiny import build_tiny_model
from posttrain.trainer.probe import compute_probe, teacher_forced_logprobs


def maxdiff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def batched(model, seqs: list[tuple[list[int], int]]) -> list[list[float]]:
    with torch.no_grad():
        x = torch.tensor([s for s, _ in seqs])
        lp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), -1)
    return [[lp[i, t - 1, s[t]].item() for t in range(st, len(s))] for i, (s, st) in enumerate(seqs)]


def main() -> None:
    torch.set_num_threads(1)
    results = {}
    for cfg in [{}, {"hidden_size": 128, "num_heads": 4, "tie_word_embeddings": False}]:
        for seed in range(3):
            folder = build_tiny_model(Path(tempfile.mkdtemp()) / "m", seed=seed, **cfg)
            load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # noqa: E731
            m32 = load()
            probe = compute_probe(m32)
            seqs = probe.sequences()
            r = {"fp32_rerun": maxdiff(probe.logprobs, teacher_forced_logprobs(m32, seqs)),
                 "fp32_batched_vs_single": maxdiff(probe.logprobs, batched(m32, seqs))}
            for name, dt in [("bf16", torch.bfloat16), ("fp16", torch.float16)]:
                low_model = load().to(dt)
                low = teacher_forced_logprobs(low_model, seqs)
                r[f"{name}_vs_fp32"] = maxdiff(probe.logprobs, low)
                r[f"{name}_weights_{name}_vs_fp32_compute"] = maxdiff(
                    low, teacher_forced_logprobs(load().to(dt).to(torch.float32), seqs))
                r[f"{name}_batched_vs_single"] = maxdiff(low, batched(low_model, seqs))
            key = f"hidden{cfg.get('hidden_size', 64)}-seed{seed}"
            results[key] = r
            print(key, json.dumps(r), flush=True)
    print("max", json.dumps({k: max(r[k] for r in results.values()) for k in next(iter(results.values()))}))


if __name__ == "__main__":
    main()
