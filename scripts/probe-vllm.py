"""Probe vLLM's CPU build against transformers, and its in-place weight reload.

Run with the PROJECT venv (vLLM lives in its own venv, see scripts/services/setup-vllm.sh,
and is reached over HTTP only):

    PYTHONPATH=. .venv/bin/python scripts/probe-vllm.py

It builds a tiny untied float32 model (hidden 128, 4 heads, 2 KV heads: vLLM's CPU attention
needs head_dim 32+), starts vLLM on it with start-vllm.sh, checks that greedy completions with
token ids and logprobs match transformers (same tokens, logprobs within 1e-5), writes perturbed
weights to a second folder, reloads them in place (pause, collective_rpc reload_weights,
resume), checks the outputs now match the new weights, and stops vLLM. Exit status 0 when every
check passes. Prints a table of timings.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
SERVICES = REPO / "scripts" / "services"
PORT = int(os.environ.get("VLLM_PORT", "18000"))
NAME = os.environ.get("VLLM_MODEL_NAME", "tiny")
URL = f"http://127.0.0.1:{PORT}"
TOL = 1e-5
PROMPTS = [[10, 20, 30], [5, 6, 7, 8, 9, 100, 200], [300, 1, 42]]
MAX_TOKENS = 8


def build_models(root: Path) -> tuple[Path, Path]:
    """Model A (seed 0, untied) and model B: A's weights plus noise, in its own folder."""
    import torch
    from safetensors.torch import load_file, save_file

    from posttrain.models.tiny import build_tiny_model

    a = build_tiny_model(
        root / "a", seed=0, hidden_size=128, num_heads=4, num_kv_heads=2, tie_word_embeddings=False
    )
    b = root / "b"
    shutil.copytree(a, b)
    weights = load_file(a / "model.safetensors")
    assert "lm_head.weight" in weights, "untied model must save lm_head.weight"
    g = torch.Generator().manual_seed(1)
    perturbed = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in weights.items()}
    save_file(perturbed, b / "model.safetensors", metadata={"format": "pt"})
    return a, b


def reference(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation and the chosen tokens' logprobs, computed with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            toks, lps = [], []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1].double()
                logp = torch.log_softmax(logits, -1)
                t = int(torch.argmax(logp))
                toks.append(t)
                lps.append(float(logp[t]))
                ids.append(t)
            out.append((toks, lps))
    return out


def complete(prompt: list[int]) -> tuple[list[int], list[float]]:
    r = requests.post(
        f"{URL}/v1/completions",
        json={
            "model": NAME,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,  # compare all MAX_TOKENS steps (min_tokens would mask EOS logits)
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
        timeout=120,
    )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    toks = choice["token_ids"]
    lps = choice["logprobs"]["token_logprobs"]
    named = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
    assert named == toks, f"token_ids {toks} disagree with logprobs.tokens {named}"
    return toks, lps


def compare(label: str, ref, got) -> bool:
    ok = True
    for prompt, (rt, rl), (gt, gl) in zip(PROMPTS, ref, got):
        err = max(abs(a - b) for a, b in zip(rl, gl)) if gt == rt else float("nan")
        good = gt == rt and err <= TOL
        ok &= good
        print(f"  {label:7s} prompt={prompt} tokens={'same' if gt == rt else 'DIFFER'} "
              f"max|dlogprob|={err:.2e} {'ok' if good else 'FAIL'}")
        if gt != rt:
            print(f"          transformers={rt}\n          vllm        ={gt}")
    return ok


def post(path: str, **kw) -> dict:
    r = requests.post(f"{URL}{path}", timeout=120, **kw)
    if r.status_code != 200:
        raise RuntimeError(f"POST {path} -> {r.status_code}: {r.text[:500]}")
    return r.json() if r.content else {}


def rss_mb() -> str:
    """Total RSS of vLLM's process group (API server, EngineCore, worker)."""
    pidf = Path(os.environ.get("POSTTRAIN_SERVICES_DIR", "/tmp/posttrain-services")) / "vllm" / "vllm.pid"
    try:
        pgid = pidf.read_text().strip()
        ps = subprocess.run(["ps", "-e", "-o", "pgid=,rss=,comm="], capture_output=True, text=True).stdout
        rows = [line.split(None, 2) for line in ps.splitlines() if line.split()[0] == pgid]
        return f"{sum(int(r[1]) for r in rows) / 1024:.0f} MB in {len(rows)} processes"
    except Exception as e:  # noqa: BLE001 - informative only
        return f"? ({e})"


def main() -> int:
    timings: list[tuple[str, float]] = []
    root = Path(tempfile.mkdtemp(prefix="probe-vllm-"))
    started = False
    ok = True
    try:
        t = time.perf_counter()
        a, b = build_models(root)
        ref_a, ref_b = reference(a), reference(b)
        timings.append(("build models + transformers refs", time.perf_counter() - t))
        assert ref_a != ref_b, "perturbation did not change the greedy outputs; pick a larger one"

        t = time.perf_counter()
        env = dict(os.environ, VLLM_PORT=str(PORT), VLLM_MODEL_NAME=NAME)
        subprocess.run(["bash", str(SERVICES / "start-vllm.sh"), str(a)], check=True, env=env)
        started = True
        timings.append(("start vLLM (/health 200 + 1 token)", time.perf_counter() - t))

        t = time.perf_counter()
        first = complete(PROMPTS[0])
        timings.append(("first completion (warm-up)", time.perf_counter() - t))
        t = time.perf_counter()
        got_a = [first] + [complete(p) for p in PROMPTS[1:]]
        timings.append((f"{len(PROMPTS) - 1} more completions", time.perf_counter() - t))
        print(f"vLLM RSS after warm-up: {rss_mb()}")
        ok &= compare("model A", ref_a, got_a)

        t = time.perf_counter()
        paused = post("/pause", params={"mode": "wait"})
        res = post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(b)}})
        resumed = post("/resume")
        timings.append(("reload B (pause+rpc+resume)", time.perf_counter() - t))
        print(f"pause -> {paused}  collective_rpc -> {res}  resume -> {resumed}")

        t = time.perf_counter()
        got_b = [complete(p) for p in PROMPTS]
        timings.append((f"{len(PROMPTS)} completions after reload", time.perf_counter() - t))
        ok &= compare("model B", ref_b, got_b)

        t = time.perf_counter()
        post("/pause", params={"mode": "wait"})
        post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(a)}})
        post("/resume")
        timings.append(("reload A back", time.perf_counter() - t))
        back = [complete(p) for p in PROMPTS]
        same = back == got_a
        print(f"  back to A: outputs {'bit-identical to the first run' if same else 'DIFFER from the first run'}")
        ok &= same
        print(f"vLLM RSS at the end: {rss_mb()}")
    finally:
        if started:
            t = time.perf_counter()
            subprocess.run(["bash", str(SERVICES / "stop-vllm.sh")], check=False)
            timings.append(("stop vLLM (all processes gone)", time.perf_counter() - t))
        shutil.rmtree(root, ignore_errors=True)
        print("\n| step | seconds |\n|---|---:|")
        for name, secs in timings:
            print(f"| {name} | {secs:.2f} |")
    print("\nPROBE", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
