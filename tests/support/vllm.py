"""Helpers of the tests against real vLLM (CPU build, in its own venv): skip when the venv is
missing (fail with POSTTRAIN_REQUIRE_VLLM=1), tiny models vLLM can run, and transformers'
greedy answers to compare with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROMPTS = [[10, 20, 30], [5, 6, 7, 8, 9, 100, 200]]
MAX_TOKENS = 6
TOL = 1e-5

Greedy = list[tuple[list[int], list[float]]]


def require_vllm() -> None:
    """Skip the calling test module without vLLM's venv, or fail it when the run requires vLLM."""
    from posttrain.serve.vllm.process import default_python

    if default_python().is_file():
        return
    reason = f"vLLM's venv is missing ({default_python()}); run scripts/services/setup-vllm.sh"
    if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
        pytest.fail(f"POSTTRAIN_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


# vLLM 0.32's CPU build computes bfloat16 attention with AMX tiles where the CPU has them (Sapphire Rapids
# and later, `amx_bf16` in lscpu), and that kernel dies of SIGILL in cpu_attention_with_kv_cache on the
# smallest shapes: hidden 128 (4 heads, 2 KV), 192 (3, 1), 256 (4, 2) all killed the worker at the first
# token, 384 (6 heads, 2 KV) and 576 (9, 3, as SmolLM2) served (measured 2026-12-07). A model served in
# bfloat16, or at the default dtype ("auto": bfloat16 for a float32 checkpoint on the CPU), has this shape.
BF16_SHAPE = {"hidden_size": 384, "num_heads": 6, "num_kv_heads": 2}
FLOAT32_SHAPE = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2}


def vllm_model(path: Path, *, seed: int = 0, tied: bool = False, shape: dict | None = None) -> Path:
    """A tiny float32 Qwen2 that vLLM's CPU build runs, tied or not: head_dim 32 in float32
    (``FLOAT32_SHAPE``, the default), ``shape=BF16_SHAPE`` for one that vLLM serves in bfloat16."""
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(path, seed=seed, tie_word_embeddings=tied, **(shape or FLOAT32_SHAPE))


def perturbed(src: Path, dst: Path, seed: int, scale: float = 0.05) -> Path:
    """``src`` with every weight moved by Gaussian noise, saved with transformers (ties kept)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(dst)
    for name in os.listdir(src):  # the tokenizer files
        if name.startswith(("tokenizer", "special_tokens")) and not (dst / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst


def transformers_greedy(model_dir: Path, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> Greedy:
    """Greedy tokens and their logprobs under transformers, in float64 softmax over float32 logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, toks, lps = list(prompt), [], []
            for _ in range(max_tokens):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
                t = int(torch.argmax(logp))
                toks.append(t)
                lps.append(float(logp[t]))
                ids.append(t)
            out.append((toks, lps))
    return out


def assert_matches(got: Greedy, want: Greedy, tol: float = TOL) -> None:
    """``got`` (served, which may stop early at an end-of-sequence token) is ``want``'s start."""
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt and gt == wt[:len(gt)], f"greedy tokens differ: {gt} != {wt}"
        worst = max(abs(x - y) for x, y in zip(gl, wl, strict=True))
        assert worst <= tol, f"logprobs differ by {worst:.2e} (> {tol:g})"


def served_greedy(api, prompts: list[list[int]] = PROMPTS) -> tuple[Greedy, str | None]:
    """Greedy tokens and logprobs the server of ``api`` (a ``tests.support.serving.Api``) answers for
    each prompt, and the snapshot identity stamped on the last answer."""
    out, identity = [], None
    for prompt in prompts:
        # no ignore_eos: the gateway refuses every sampling control but temperature and top_p
        reply = api.complete(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
        choice = reply["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
        identity = reply["snapshot_identity"]
    return out, identity


def with_probe(model_dir: Path) -> Path:
    """Write the probe a trainer would (``posttrain.probe.json``) into ``model_dir``, from its weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.trainer.probe import write_checkpoint_probe

    write_checkpoint_probe(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), model_dir)
    return model_dir


class KeepsOneTensor:
    """An engine client whose reload keeps one tensor's old value (``tensor`` from ``old``): the engine
    answers differently afterwards, its layout is right, and it does not hold the version."""

    def __init__(self, inner, tensor: str, old: Path, scratch: Path):
        self.inner, self.tensor, self.old, self.scratch = inner, tensor, old, scratch

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reload(self, folder: Path) -> None:
        import shutil

        from safetensors.torch import load_file, save_file

        mixed = self.scratch / folder.name
        shutil.rmtree(mixed, ignore_errors=True)
        shutil.copytree(folder, mixed)
        for shard in mixed.glob("*.safetensors"):
            weights = load_file(shard)
            if self.tensor in weights:
                old = {}
                for src in self.old.glob("*.safetensors"):
                    old.update(load_file(src))
                weights[self.tensor] = old[self.tensor]
                save_file(weights, shard, metadata={"format": "pt"})
        self.inner.reload(mixed)
