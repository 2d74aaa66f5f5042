"""``POST /v1/completions`` with token ids in and out: the request's checks and the reply's shape.

Only ``temperature`` and ``top_p`` are sampling controls here (docs/hotload-api.md); any other one
is refused with a 400 that names it, rather than silently ignored, because a rollout sampled
under a different distribution than the one the trainer assumes corrupts RL.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from posttrain.serve.sampler import SampledChoice

ACCEPTED = {
    "model", "prompt", "n", "max_tokens", "temperature", "top_p", "logprobs", "return_tokens_as_token_ids",
    "echo", "seed", "stream", "user",
}
UNSUPPORTED_CONTROLS = {
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
    "logit_bias", "best_of", "min_tokens", "length_penalty", "use_beam_search", "suffix", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "response_format", "bad_words", "allowed_token_ids", "typical_p", "truncate_prompt_tokens",
}


class RequestError(Exception):
    """A request the server refuses: HTTP status, message and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class CompletionParams:
    prompts: list[list[int]]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None


DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default


def check_request_size(body: object, limit: int | None) -> None:
    """Refuse (400, naming the limit) a request whose prompts × n × max_tokens is over ``limit``:
    the tokens one request may ask to generate. Fields that are malformed are left to the full
    checks (``parse_request``, or the engine behind a gateway)."""
    if limit is None or not isinstance(body, dict):
        return
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt) else 1
    n = body.get("n")
    n = n if _is_int(n) and n > 0 else 1
    max_tokens = body.get("max_tokens")
    max_tokens = max_tokens if _is_int(max_tokens) and max_tokens > 0 else DEFAULT_MAX_TOKENS
    asked = prompts * n * max_tokens
    if asked > limit:
        raise RequestError(400, f"prompts ({prompts}) x n ({n}) x max_tokens ({max_tokens}) = {asked} tokens is over "
                                f"this server's limit of {limit} tokens per request (max_request_tokens); split the "
                                "request", "prompt")


def parse_request(body: object, *, model_name: str, vocab_size: int, max_positions: int | None,
                  max_tokens_limit: int, max_n: int, max_request_tokens: int | None = None) -> CompletionParams:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key in UNSUPPORTED_CONTROLS and value is not None:  # an explicit null sets nothing
            raise RequestError(400, f"{key} is not supported: the only sampling controls are temperature and "
                                    "top_p", key)
        if key not in ACCEPTED and key not in UNSUPPORTED_CONTROLS:
            raise RequestError(400, f"unknown field {key}", key)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "model is required", "model")
    if model != model_name:
        raise RequestError(404, f"the model `{model}` does not exist (this server serves `{model_name}`)", "model",
                           "NotFoundError")
    if body.get("stream"):
        raise RequestError(400, "stream is not supported", "stream")
    if body.get("echo"):
        raise RequestError(400, "echo is not supported: completions carry the completion tokens only", "echo")
    if body.get("return_tokens_as_token_ids") is False:
        raise RequestError(400, "tokens are always returned as token_id:<int>", "return_tokens_as_token_ids")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 1):
        raise RequestError(400, "logprobs must be 0 or 1: only the sampled token's log-prob is returned", "logprobs")
    prompts = _prompts(body.get("prompt"), vocab_size)
    n = _int(body, "n", 1, 1, max_n)
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, max_tokens_limit)
    check_request_size(body, max_request_tokens)
    if max_positions is not None:
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > max_positions:
            raise RequestError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                    f"context of {max_positions}", "max_tokens")
    temperature = _float(body, "temperature", 1.0, 0.0, 100.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise RequestError(400, "top_p must be in (0, 1]", "top_p")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(400, "seed must be an integer", "seed")
    return CompletionParams(prompts, n, max_tokens, temperature, top_p, None if seed is None else seed % 2**63)


def build_response(params: CompletionParams, choices: list[SampledChoice], *, model_name: str,
                   snapshot_identity: str | None, decode) -> dict:
    out = []
    for i, c in enumerate(choices):
        out.append({
            "index": i,
            "prompt_index": i // params.n,
            "text": decode(c.token_ids),
            "token_ids": c.token_ids,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in c.token_ids],
                "token_logprobs": c.logprobs,
                "top_logprobs": None,
                "text_offset": None,
            },
            "finish_reason": c.finish_reason,
        })
    prompt_tokens = sum(len(p) for p in params.prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "snapshot_identity": snapshot_identity,  # which weights sampled these: the rollout's policy version
        "choices": out,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def _prompts(value: object, vocab_size: int) -> list[list[int]]:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise RequestError(400, "prompt must be token ids (a list of ints, or a list of such lists); text prompts "
                                "are not accepted", "prompt")
    if not isinstance(value, list) or not value:
        raise RequestError(400, "prompt must be a non-empty list of token ids, or a list of such lists", "prompt")
    prompts = value if all(isinstance(v, list) for v in value) else [value]
    for p in prompts:
        if not isinstance(p, list) or not p or not all(_is_int(t) for t in p):
            raise RequestError(400, "every prompt must be a non-empty list of integer token ids", "prompt")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
    return prompts


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise RequestError(400, f"{key} must be an integer in [{lo}, {hi}]", key)
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RequestError(400, f"{key} must be a number in [{lo}, {hi}]", key)
    return float(v)
