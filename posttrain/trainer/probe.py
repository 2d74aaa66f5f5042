"""A checkpoint's probe (``posttrain.chain.probe``), computed on the weights the trainer saved.

The trainer calls :func:`write_checkpoint_probe` with the model whose weights it has just written,
before the file that makes the checkpoint complete (``trainer_state.json``), so a checkpoint the
watch hands out already has its probe. The expected answers are computed the way an engine is
asked to check them: the completion is the greedy one, and its logprobs are teacher-forced (one
forward pass over prompt + completion, one sequence at a time, no padding), log-softmax of the
raw logits in float32. Imports torch only when called.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from posttrain.chain.probe import DTYPES, PROBE_COMPLETION_TOKENS, Probe, probe_prompts, write_probe

log = logging.getLogger(__name__)


def dtype_name(model) -> str:
    """The dtype of the model's weights as the probe names it ("float32", "bfloat16", ...)."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def probe_vocab_size(model) -> int:
    """The vocabulary the prompts are drawn from: token ids every engine of this model accepts."""
    rows = model.get_input_embeddings().num_embeddings
    configured = getattr(model.config, "vocab_size", None)
    return min(rows, configured) if isinstance(configured, int) and configured > 0 else rows


@contextmanager
def _evaluating(model) -> Iterator[None]:
    import torch

    was_training = model.training
    model.eval()  # no dropout
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def teacher_forced_logprobs(model, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
    """For each ``(token ids, start)``, the logprob of every token from ``start`` on given the ones
    before it: one forward pass per sequence (no padding, so batching cannot change an answer)."""
    import torch

    device = next(model.parameters()).device
    out: list[list[float]] = []
    with _evaluating(model):
        for ids, start in sequences:
            if not 1 <= start < len(ids):
                raise ValueError(f"a probe sequence of {len(ids)} tokens cannot start its completion at {start}")
            x = torch.tensor([ids], dtype=torch.long, device=device)
            logits = model(input_ids=x, use_cache=False).logits[0, start - 1 : -1].float()
            logps = torch.log_softmax(logits, dim=-1)
            out.append(logps.gather(-1, x[0, start:, None]).squeeze(-1).tolist())
    return out


def compute_probe(model, *, completion_tokens: int = PROBE_COMPLETION_TOKENS) -> Probe:
    """The probe of ``model`` as it is in memory: greedy completions of the fixed prompts, and
    their teacher-forced logprobs."""
    import torch

    dtype = dtype_name(model)
    if dtype not in DTYPES:
        raise ValueError(f"a probe covers float32, bfloat16 and float16 weights, not {dtype}")
    vocab = probe_vocab_size(model)
    prompts = probe_prompts(vocab)
    device = next(model.parameters()).device
    with _evaluating(model):
        ids = torch.tensor(prompts, dtype=torch.long, device=device)  # equal lengths: no padding
        for _ in range(completion_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1, :vocab]
            ids = torch.cat([ids, logits.float().argmax(-1, keepdim=True)], dim=1)
    completions = ids[:, len(prompts[0]) :].tolist()
    logprobs = teacher_forced_logprobs(model, [(p + c, len(p)) for p, c in zip(prompts, completions, strict=True)])
    return Probe(dtype=dtype, vocab_size=vocab, prompts=prompts, completions=completions, logprobs=logprobs)


def is_adapter_model(model) -> bool:
    return hasattr(model, "peft_config")


def write_checkpoint_probe(model, folder: str | os.PathLike[str]) -> Probe | None:
    """Compute ``model``'s probe and write it into the checkpoint ``folder`` (atomically).

    Skipped (None) for a LoRA adapter: what is published is the adapter merged into its base
    (``posttrain.lora.merge``), whose rounding the unmerged model in memory does not reproduce,
    and the merged folder would not carry the file. Skipped too for weights of another dtype.
    """
    if is_adapter_model(model):
        return None
    if dtype_name(model) not in DTYPES:
        log.warning("no probe for %s: weights of dtype %s", folder, dtype_name(model))
        return None
    probe = compute_probe(model)
    write_probe(Path(folder), probe)
    return probe
