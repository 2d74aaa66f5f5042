"""Check 3, ``replies``: every answered request was computed with the weights it is stamped with.

For each reply with status 200 in ``replies.jsonl`` (greedy requests: temperature 0):

- its identity is one the production history switched to, or none: the boot weights, read from
  soak.json's ``base_model`` folder (the store does not hold them);
- that version is rebuilt from the store by this checker (``check_store``: no posttrain code),
  loaded into the model class its ``config.json`` names with transformers, and run once over
  the prompt and the returned tokens (teacher forcing, float32 or the weights' own dtype, CPU);
- every returned token is the greedy choice there (its log-prob within ``tie_tolerance`` of the
  best one: a tie may go either way), its returned log-prob is log_softmax of the logits within
  ``tolerance`` (float32 on CPU: 1e-3; a batched, cached decode and one forward pass differ by
  about 1e-5), and NaN or inf is refused;
- a reply shorter than ``max_tokens`` ends with an end-of-sequence token (the config's), and none
  comes before the end.

Replies with another status (or none: the connection failed) are counted, not checked.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from posttrain.testing.soak.check_context import Context
from posttrain.testing.soak.check_model import CheckResult, finite
from posttrain.testing.soak.check_store import NP_DTYPES, Rebuilt, content_digest, parse_safetensors

TOLERANCE = {"F32": 1e-3, "F64": 1e-3, "BF16": 5e-2, "F16": 2e-2}
MAX_REPORTED_PER_IDENTITY = 5


def check_replies(ctx: Context) -> CheckResult:
    res = CheckResult("replies")
    replies = ctx.soak.records["replies"]
    res.items = len(replies)
    statuses = Counter(str(r.get("status")) for r in replies if r.get("status") != 200)
    if statuses:
        res.notes.append(f"{sum(statuses.values())} replies without status 200 not checked: {dict(statuses)}")
    answered = [r for r in replies if r.get("status") == 200]
    served = _served_by_production(ctx)
    by_identity: dict[str | None, list[dict]] = {}
    for r in answered:
        by_identity.setdefault(r.get("identity"), []).append(r)
    rebuilt = ctx.rebuilt[0]
    base = ctx.soak.meta.get("base_model")
    _note_identical(res, {i: rebuilt[i] for i in by_identity if i in rebuilt}, base if None in by_identity else None)
    for ident, rows in sorted(by_identity.items(), key=lambda kv: kv[0] or ""):
        if ident is None:
            if not base or not (Path(base) / "config.json").is_file():
                res.notes.append(f"{len(rows)} replies from the boot weights (no identity) not recomputed: "
                                 f"soak.json names no base_model folder that exists ({base!r})")
                continue
            model, eos, dtype = _load_folder(Path(base))
        else:
            if served is not None and ident not in served:
                res.bad(f"{len(rows)} replies stamped {ident}, which no production history record switched to")
            version = rebuilt.get(ident)
            if version is None:
                res.bad(f"{len(rows)} replies stamped {ident}, which the store cannot rebuild "
                        f"({'absent' if ident not in ctx.snapshots else 'see the snapshots check'})")
                continue
            model, eos, dtype = _load(version)
        ident = ident or "null (the boot weights)"
        tol = TOLERANCE.get(dtype, 1e-3)
        wrong = 0
        for r in rows:
            why = _check_one(model, eos, r, tol)
            if why:
                wrong += 1
                if wrong <= MAX_REPORTED_PER_IDENTITY:
                    res.bad(f"reply at {r.get('at')} stamped {ident}: {why}")
        if wrong > MAX_REPORTED_PER_IDENTITY:
            res.bad(f"... and {wrong - MAX_REPORTED_PER_IDENTITY} more replies stamped {ident} that its weights "
                    "do not give")
    return res


def _note_identical(res: CheckResult, versions: dict, base: str | None) -> None:
    """Say when identities that replies are stamped with hold the same weights: a reply computed with
    one of them but stamped with another cannot be told apart from a right one."""
    digests: dict[str, list[str]] = {}
    for ident, version in versions.items():
        digests.setdefault(content_digest(version.tensors), []).append(ident)
    if base and (Path(base) / "config.json").is_file():
        digests.setdefault(content_digest(_folder_tensors(Path(base))), []).append("the boot weights")
    for same in digests.values():
        if len(same) > 1:
            res.notes.append(f"{', '.join(sorted(same))} hold identical weights: replies stamped with one of them "
                             "cannot be told from replies of another")


def _served_by_production(ctx: Context) -> set[str] | None:
    """Every identity a production history switched to; None when there is no production history."""
    out: set[str] = set()
    found = False
    for role, entry in ctx.soak.productions().items():
        rep = ctx.histories.get(ctx.soak.history_of(entry, role)[0])
        if rep is not None:
            found = True
            out |= rep.switched_to
    return out if found else None


def _load(version):  # noqa: ANN001, ANN202 - check_store.Rebuilt -> (model, eos ids, dtype)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_obj = json.loads(version.config or b"{}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_bytes(version.config or b"{}")
        config = AutoConfig.from_pretrained(tmp)
    dtypes = Counter(dtype for dtype, _, _ in version.tensors.values())
    dtype = dtypes.most_common(1)[0][0]
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}[dtype]
    model = AutoModelForCausalLM.from_config(config).to(torch_dtype)
    state = {}
    for name, (dt, shape, data) in version.tensors.items():
        arr = np.frombuffer(data, dtype=NP_DTYPES[dt]).reshape(shape).copy()
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if dt == "BF16" else torch.from_numpy(arr)
        state[name] = t
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"the rebuilt weights do not fit {type(model).__name__}: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    if tied:
        model.tie_weights()
    model.eval()
    eos = config_obj.get("eos_token_id")
    eos_ids = {eos} if isinstance(eos, int) else {e for e in (eos or []) if isinstance(e, int)}
    return model, eos_ids, dtype


def _folder_tensors(folder: Path) -> dict:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        data = shard.read_bytes()
        _, found, _ = parse_safetensors(data, str(shard))
        tensors.update({name: (dt, shape, data[b:e]) for name, (dt, shape, b, e) in found.items()})
    return tensors


def _load_folder(folder: Path):  # noqa: ANN202 - (model, eos ids, dtype) of the boot weights
    return _load(Rebuilt(_folder_tensors(folder), (folder / "config.json").read_bytes(), 0))


def _check_one(model, eos: set[int], r: dict, tol: float) -> str | None:  # noqa: ANN001
    import torch

    prompt, tokens, logprobs = r.get("prompt_ids") or [], r.get("token_ids") or [], r.get("logprobs") or []
    if not prompt or not tokens:
        return f"{len(prompt)} prompt and {len(tokens)} completion tokens (a 200 reply must carry both)"
    if len(logprobs) != len(tokens):
        return f"{len(logprobs)} log-probs for {len(tokens)} tokens"
    if not finite(*logprobs):
        return "a log-prob is NaN, infinite or not a number"
    if not finite(r.get("temperature", 0.0)) or r.get("temperature", 0.0) > 1e-5:
        return f"temperature {r.get('temperature')!r}: only greedy replies can be recomputed"
    ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()
    logp = logits.log_softmax(-1)
    if not bool(torch.isfinite(logp).all()):
        return "the weights give NaN or infinite log-probs"
    best = logp.max(-1).values
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        mine, top = float(logp[i, tok]), float(best[i])
        if not finite(mine, top) or top - mine > tol:
            return (f"token {i} ({tok}) is not the greedy choice: its log-prob is {mine:.5f}, the best "
                    f"{top:.5f} (token {int(logp[i].argmax())})")
        if abs(mine - lp) > tol:
            return f"token {i} ({tok}): the reply's log-prob {lp:.5f}, the weights give {mine:.5f}"
        if eos and tok in eos and i < len(tokens) - 1:
            return f"token {i} is end-of-sequence ({tok}) but the reply goes on"
    max_tokens = r.get("max_tokens")
    if eos and isinstance(max_tokens, int) and len(tokens) < max_tokens and tokens[-1] not in eos:
        return f"{len(tokens)} tokens of max_tokens {max_tokens}, and the last ({tokens[-1]}) is no end-of-sequence"
    return None
