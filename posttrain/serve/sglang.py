"""SGLang as the serving engine (``posttrain serve --engine sglang``): servers someone else runs.

The gateway does not start or supervise SGLang: ``engine_urls`` name SGLang servers (one replica
each) that must read the gateway's rebuilt folders at the same paths (same machine or a shared
file system). A replica that stops answering is reported ERROR until it answers again; restarting
it is up to whoever runs it.

``SGLangClient`` speaks SGLang's native HTTP API (``docs/sglang-http-api.md``, from SGLang's source):

- ``health``: ``GET /get_model_info`` (``/health`` runs a real generation and can take 20 s);
- ``complete``: an OpenAI completions body (token-id prompts; the controls ``completions`` accepts,
  plus ``prompt_logprobs``) becomes one batched ``POST /generate`` (``input_ids``, each prompt
  repeated ``n`` times, ``sampling_params``, ``return_logprob``, ``logprob_start_len``), and the
  reply the OpenAI shape the gateway returns, with SGLang's ``meta_info.weight_version``;
- ``pause``: ``POST /pause_generation {"mode": "abort"}``; ``reload``: ``POST
  /update_weights_from_disk`` (``weight_version`` = the folder's name); ``resume``: ``POST
  /continue_generation``;
- ``read_layout``/``read_held``: parameters read back through ``/get_weights_by_name``, hashed here
  (``sglang_readback``).

Pause mode: none of SGLang's lets in-flight requests finish on the old weights. ``abort`` ends them
(their reply says so and the gateway answers 503); ``in_place``/``retract`` continue them on the new
weights, so one completion would mix two versions, which corrupts RL. The gateway already waits for
its own requests before pausing, so only requests sent to SGLang directly can be aborted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from posttrain.serve.completions import CompletionParams, RequestError, build_response, parse_request
from posttrain.serve.engine import EngineCallError
from posttrain.serve.http_client import HTTPEngineClient
from posttrain.serve.remote import RemoteEngine, Replica
from posttrain.serve.sampler import SampledChoice
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.sglang_readback import READBACK_MAX_ELEMENTS, SGLangReadback

log = logging.getLogger(__name__)

NO_LIMIT = 1 << 31  # SGLang checks token ids and lengths itself
PAUSE_MODE = "abort"  # see the module doc


class SGLangClient(SGLangReadback, HTTPEngineClient):
    """One SGLang server at ``url`` (e.g. ``http://sglang-host:30000``), an ``EngineClient``. ``model_dir``:
    the model it serves, as the gateway reads it (for the readback: the dtype ``--dtype auto`` became and the
    size of a tensor before asking for it)."""

    def __init__(self, url: str, *, timeout: float = 60.0, model_dir: Path | None = None,
                 readback_max_elements: int = READBACK_MAX_ELEMENTS) -> None:
        super().__init__(url, timeout=timeout)
        self.model_dir = model_dir
        self.readback_max_elements = readback_max_elements

    def health(self, *, timeout: float = 5.0) -> bool:
        """True when ``GET /get_model_info`` answers 200: the server is up (it does not generate)."""
        return self._answers("/get_model_info", timeout)

    def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``: model_path, weight_version, ..."""
        return self._json("GET", "/get_model_info")

    def weight_version(self) -> str | None:
        """The name of the weights SGLang holds now (``get_model_info``'s ``weight_version``): the gateway
        names every reload after its folder, so this says which version SGLang holds (``holding``)."""
        version = self.model_info().get("weight_version")
        return str(version) if version is not None else None

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI completions body through ``POST /generate``; the OpenAI-style answer.

        Raises ``RequestError`` (400, naming the field) for a body it cannot translate, and
        ``EngineCallError`` (503) when SGLang aborted the request (paused with mode abort)."""
        params, generate = to_generate(body)
        outs = self._json("POST", "/generate", json=generate)
        return from_generate(params, outs, model=str(body.get("model")), prompt_logprobs=generate["logprob_start_len"] == 0)

    def pause(self) -> None:
        """``POST /pause_generation`` with mode abort (the module doc says why)."""
        self._json("POST", "/pause_generation", json={"mode": PAUSE_MODE})

    def reload(self, folder: Path) -> None:
        """``POST /update_weights_from_disk``: load ``folder`` (a path on SGLang's machine) and call the
        weights ``folder.name``. SGLang's refusal (``success: false``, 400) is an ``EngineCallError``
        with SGLang's message; after one SGLang has put its previous weights back."""
        payload = {"model_path": str(folder), "weight_version": folder.name, "flush_cache": True,
                   "abort_all_requests": False}
        reply = self._json("POST", "/update_weights_from_disk", json=payload)
        if not isinstance(reply, dict) or reply.get("success") is not True:
            message = reply.get("message") if isinstance(reply, dict) else None
            raise EngineCallError(200, f"POST /update_weights_from_disk: {message or reply!r}")

    def resume(self) -> None:
        """``POST /continue_generation``."""
        self._json("POST", "/continue_generation", json={})


def to_generate(body: dict[str, Any]) -> tuple[CompletionParams, dict[str, Any]]:
    """The checked completion parameters and the ``/generate`` body for an OpenAI completions body."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    body = dict(body)
    prompt_logprobs = body.pop("prompt_logprobs", None)
    if prompt_logprobs is not None and (isinstance(prompt_logprobs, bool) or prompt_logprobs not in (0, 1)):
        raise RequestError(400, "prompt_logprobs must be 0 or 1: only each prompt token's log-prob is returned",
                           "prompt_logprobs")
    params = parse_request(body, model_name=str(body.get("model") or ""), vocab_size=NO_LIMIT, max_positions=None,
                           max_tokens_limit=NO_LIMIT, max_n=NO_LIMIT)
    input_ids = [p for p in params.prompts for _ in range(params.n)]  # OpenAI's order: prompt-major
    sampling: dict[str, Any] | list[dict[str, Any]] = {
        "max_new_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
    if params.seed is not None:  # SamplingParams.sampling_seed; one per row, or the n copies would be equal
        sampling = [dict(sampling, sampling_seed=(params.seed + k) % 2**63) for k in range(len(input_ids))]
    generate = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
                "logprob_start_len": 0 if prompt_logprobs else -1, "stream": False}
    return params, generate


def from_generate(params: CompletionParams, outs: Any, *, model: str, prompt_logprobs: bool) -> dict[str, Any]:
    """The OpenAI completions answer for SGLang's ``/generate`` reply to ``to_generate``'s body."""
    if isinstance(outs, dict):
        outs = [outs]
    expected = len(params.prompts) * params.n
    if not isinstance(outs, list) or len(outs) != expected:
        raise EngineCallError(502, f"POST /generate: expected {expected} outputs, got {_kind(outs)}")
    choices, texts, prompts, version = [], [], [], None
    for out in outs:
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            raise EngineCallError(503, f"SGLang aborted the request: {finish.get('message') or 'no reason given'}")
        pairs = meta.get("output_token_logprobs")
        if not isinstance(pairs, list):
            raise EngineCallError(502, "POST /generate: the reply has no meta_info.output_token_logprobs")
        choices.append(SampledChoice([int(p[1]) for p in pairs], [float(p[0]) for p in pairs],
                                     "stop" if kind == "stop" else "length"))
        texts.append(out.get("text", ""))
        prompts.append([None if p[0] is None else {str(p[1]): {"logprob": float(p[0])}}
                        for p in meta.get("input_token_logprobs") or []])
        version = version or meta.get("weight_version")
    text_of = iter(texts)
    reply = build_response(params, choices, model_name=model, snapshot_identity=None, decode=lambda _: next(text_of))
    if prompt_logprobs:
        for choice, prompt in zip(reply["choices"], prompts, strict=True):
            choice["prompt_logprobs"] = prompt
    reply["weight_version"] = version  # SGLang's name for the weights that finished these
    return reply


def _kind(value: object) -> str:
    return f"{len(value)}" if isinstance(value, list) else type(value).__name__


def open_sglang_engine(config: ServeConfig) -> RemoteEngine:
    """SGLang replicas for the gateway, one per ``config.engine_urls`` (servers someone else runs: not
    started, supervised or restarted here). Each must answer ``/get_model_info`` now."""
    name = config.served_model_name or config.model_dir.resolve().name
    replicas: list[Replica] = []
    for i, url in enumerate(config.engine_urls):
        client = SGLangClient(url, model_dir=config.model_dir)
        try:
            info = client.model_info()
        except EngineCallError as e:
            client.close()
            for r in replicas:
                r.client.close()
            raise ValueError(f"engine_urls[{i}] {url}: SGLang does not answer GET /get_model_info ({e})") from None
        log.info("sglang-%d at %s serves %s (weight version %s)", i, url, info.get("model_path"),
                 info.get("weight_version"))
        replicas.append(Replica(f"sglang-{i}", client))
    return RemoteEngine(kind="sglang", model_dir=config.model_dir, model_name=name, replicas=replicas,
                        reload=config.reload, restart_when_tied=False, monitor_interval_s=config.probe_interval_s,
                        idle_interval_s=config.idle_probe_interval_s,
                        max_request_tokens=config.max_request_tokens, max_tokens_limit=config.max_tokens_limit,
                        max_n=config.max_n)
