"""The reference engine: a transformers causal LM served in this process (``--engine reference``).

Completions are sampled in one batch per request (``sampler``); a hot-load loads the rebuilt
folder beside the served model and swaps the reference (``model_slot``), so a request never
sees two versions and in-flight requests finish on the weights they began with.

Before the swap the loaded model's parameters are read back (``model_slot.read_back``: a digest of
each as held, compared exactly with the folder's tensors in that dtype) and the folder's probe is
checked; either failing leaves the previous version served. The digests found then are kept: a
monitor thread reads the parameters back every ``probe_interval_s`` (and ``verify`` on demand), and
a served model that no longer holds them puts every replica in ERROR and answers 503 until it does.
Test faults (``faults``: stale_weights, cached_weights) make a hot-load leave other weights in place.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from posttrain.chain.checkpoint import INDEX_NAME, SINGLE_NAME
from posttrain.lora.packed import is_packed_adapter
from posttrain.serve.adapters import refuse_adapters
from posttrain.serve.checks import model_depth
from posttrain.serve.completions import RequestError, build_response, parse_request
from posttrain.serve.engine import EngineError, Served
from posttrain.serve.faults import FaultBox
from posttrain.serve.model_slot import (
    ModelSlot,
    ServedModel,
    check_held,
    load_served,
    read_back,
    read_held,
    resolve_device,
)
from posttrain.serve.probe import judge, read_probe, score_with_model
from posttrain.serve.sampler import sample
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.stages import stage
from posttrain.serve.weight_digest import Expected

log = logging.getLogger(__name__)

MONITOR_SHARE = 4  # the monitor rests at least 4x as long as a reading took: at most 1/5 of the time reading


class ReferenceEngine:
    def __init__(self, config: ServeConfig, faults: FaultBox | None = None):
        """``faults``: the server's test faults (default: those ``config`` arms at start)."""
        self.config = config
        self.faults = faults if faults is not None else FaultBox(config.faults)
        self.device = resolve_device(config.device)
        self.model_name = config.served_model_name or config.model_dir.resolve().name
        self.tokenizer = _load_tokenizer(config.model_dir)
        boot = _boot_read_back(load_served(config.model_dir, self.device))
        self.slot = ModelSlot(boot)
        # the served model the monitor (or verify) found holding other weights, and why; None: none found
        self._failure: tuple[ServedModel, str] | None = None
        self._failure_lock = threading.Lock()
        self._closed = threading.Event()
        self.replica_names = [f"replica-{i:04d}" for i in range(config.replicas)]
        cfg = boot.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.eos_ids, self.pad_id = _special_ids(boot, self.tokenizer)
        self.generate_lock = threading.Lock()
        self._monitor = threading.Thread(target=_watch, args=(weakref.ref(self), config.probe_interval_s,
                                                              self._closed), name="reference-monitor", daemon=True)
        self._monitor.start()

    def current(self) -> Served:
        served = self.slot.current()
        return Served(served.identity, served.path)

    def load(self, folder: Path, identity: str) -> Served:
        """Load ``folder`` like the served model (same tensor names, shapes, dtypes), read its parameters
        back (exactly the folder's, none NaN or infinite), check it against the folder's probe, and swap
        it in; on failure (ValueError with the reason) the previous version keeps serving."""
        if is_packed_adapter(folder):
            raise refuse_adapters("reference", folder)
        before = self.slot.current()
        with stage("switch"):  # loading beside the served model, then the swap below; validate: its layout
            new = self._load_beside(folder, identity, before)
        with stage("validate"):
            new = read_back(new, identity)
        with stage("probe"):
            self._check_probe(new, before)
        with stage("switch"):
            self.slot.swap(new)
        with self._failure_lock:
            if self._failure is not None and self._failure[0] is not new:
                self._failure = None  # about the model swapped out: let it go
        return Served(new.identity, new.path)

    def resume(self, folder: Path, identity: str) -> Served:
        return self.load(folder, identity)

    def _load_beside(self, folder: Path, identity: str, before: ServedModel) -> ServedModel:
        """``folder`` loaded beside ``before``; test faults may leave other weights in it (the readback's
        to catch): another folder's (cached_weights), or ``before``'s values (stale_weights)."""
        cached = self.faults.take("cached_weights", identity=identity)
        source = folder if cached is None else Path(cached.folder) if cached.folder else before.path
        new = load_served(source, self.device, like=before, identity=identity)
        if cached is not None:
            log.warning("hot-load of %s: serving the weights of %s instead (injected fault)", identity, source)
            new = replace(new, path=folder)  # the engine believes it loaded the folder it was given
        stale = self.faults.take("stale_weights", identity=identity)
        if stale is not None:
            log.warning("hot-load of %s: keeping %s of the previous version (injected fault)", identity,
                        "every parameter" if stale.tensors is None else ", ".join(stale.tensors))
            _keep_previous(new.model, before.model, stale.tensors)
        return new

    def verify(self) -> None:
        """Read the served model's parameters back now; EngineError naming the tensors that are no longer
        those read back when it was loaded (every replica is then ERROR until they are again)."""
        why = self._check_served()
        if why is not None:
            raise EngineError(f"{', '.join(self.replica_names)}: {why}")

    def _check_served(self) -> str | None:
        """Why the served model no longer holds its version's weights (recorded for ``replica_errors``);
        None when it does."""
        served = self.slot.current()
        why = check_held(served, _version_name(served))
        with self._failure_lock:
            if why is not None:
                if self._failure is None or self._failure[1] != why:
                    log.error("the served model no longer holds %s's weights: %s", _version_name(served), why)
                self._failure = (served, why)
            elif self._failure is not None:  # (one about a model swapped out since is dropped, and the model)
                if self._failure[0] is served:
                    log.info("the served model holds %s's weights again", _version_name(served))
                self._failure = None
        return why

    def _served_failure(self, served: ServedModel) -> str | None:
        with self._failure_lock:
            failure = self._failure
        return failure[1] if failure is not None and failure[0] is served else None

    def _check_probe(self, new: ServedModel, before: ServedModel) -> None:
        """ValueError (the verdict's one line) when the loaded model does not answer the folder's
        probe (``posttrain.serve.probe``) as the trainer's weights did; nothing to check without one."""
        probe = read_probe(new.path)  # a malformed one raises ValueError naming the file
        if probe is None:
            return
        try:
            previous = read_probe(before.path)
        except ValueError as e:
            log.warning("not comparing with the served version's probe: %s", e)
            previous = None
        scored = score_with_model(new.model, probe.sequences())
        scored_previous = score_with_model(new.model, previous.sequences()) if previous is not None else None
        dtype = str(next(new.model.parameters()).dtype).removeprefix("torch.")
        # The reference engine computes as the trainer's probe did, to the bit, where the dtypes agree: the
        # dtype's own tolerance. Float32 weights rounded into a bfloat16 engine differ at every layer: the
        # deep model's spread (its first float32 hot-load of SmolLM2 was 0.157 off, over bfloat16's 0.1).
        layers = model_depth(new.path) if dtype != probe.dtype else None
        verdict = judge(scored, probe, scored_previous, previous, version=new.identity,
                        previous_version=before.identity, engine_dtype=dtype, layers=layers)
        if not verdict.ok:
            raise ValueError(verdict.reason)
        log.info("probe of %s: %s", new.identity, verdict.reason)

    def replica_errors(self) -> dict[str, str]:
        why = self._served_failure(self.slot.current())  # one model in this process serves every replica
        return {} if why is None else dict.fromkeys(self.replica_names, why)

    def close(self) -> None:
        self._closed.set()
        if self._monitor.is_alive() and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=30)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        except Exception:  # noqa: BLE001 - text is informative only
            return ""

    def complete(self, body: object) -> dict:
        params = parse_request(body, model_name=self.model_name, vocab_size=self.vocab_size,
                               max_positions=self.max_positions, max_tokens_limit=self.config.max_tokens_limit,
                               max_n=self.config.max_n, max_request_tokens=self.config.max_request_tokens)
        with self.generate_lock:
            served = self.slot.current()  # kept to the end: a swap meanwhile does not touch this request
            why = self._served_failure(served)
            if why is not None:
                raise RequestError(503, f"the served model does not hold {_version_name(served)}'s weights: "
                                   f"{why}", kind="ServiceUnavailableError")
            choices = sample(served.model, params.prompts, n=params.n, max_tokens=params.max_tokens,
                             temperature=params.temperature, top_p=params.top_p, eos_token_ids=self.eos_ids,
                             pad_token_id=self.pad_id, seed=params.seed,
                             max_batch_rows=self.config.max_batch_rows)
        return build_response(params, choices, model_name=self.model_name, snapshot_identity=served.identity,
                              decode=self.decode)


def _watch(engine_ref: weakref.ref[ReferenceEngine], interval: float, closed: threading.Event) -> None:
    """Every ``interval``: the served model's parameters read back and compared with its version's, until
    the engine is closed (or dropped). Hashing a large model takes seconds (it is copied to the CPU and
    read whole): the monitor then rests ``MONITOR_SHARE`` times as long as the last reading took."""
    wait = interval
    while not closed.wait(wait):
        engine = engine_ref()
        if engine is None:
            return
        t0 = time.monotonic()
        try:
            engine._check_served()
        except Exception:  # noqa: BLE001 - the monitor never dies; the next round tries again
            log.exception("reading the served model's parameters back failed")
        del engine  # held only while reading: an engine nobody holds goes, and its monitor with it
        wait = max(interval, MONITOR_SHARE * (time.monotonic() - t0))


def _version_name(served: ServedModel) -> str:
    return served.identity or "the boot weights"


def _boot_read_back(boot: ServedModel) -> ServedModel:
    """The boot model read back against its folder; a folder without safetensors weights (``.bin``)
    cannot say what it holds: the digests read now are what the monitor keeps it to."""
    if (boot.path / SINGLE_NAME).is_file() or (boot.path / INDEX_NAME).is_file():
        return read_back(boot, _version_name(boot))
    log.warning("%s has no safetensors weights: the boot model's parameters are not checked against them",
                boot.path)
    held = read_held(boot.model)
    return replace(boot, expected={n: Expected(h.dtype, h.shape, h.digest) for n, h in held.items()})


def _keep_previous(model: torch.nn.Module, previous: torch.nn.Module, names: list[str] | None) -> None:
    """Copy ``previous``'s values into ``model``'s parameters (``names``, or all): weights not updated."""
    old, new = previous.state_dict(), model.state_dict()
    unknown = sorted(set(names or ()) - set(new))
    if unknown:
        raise ValueError(f"the stale_weights fault names no parameter of the model: {unknown}")
    with torch.no_grad():
        for name in names if names is not None else new:
            new[name].copy_(old[name])


def _load_tokenizer(path: Path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a server of token ids can work without one
        log.warning("no tokenizer in %s (%s); completions will carry no text", path, type(e).__name__)
        return None


def _special_ids(served: ServedModel, tokenizer) -> tuple[set[int], int]:
    eos: set[int] = set()
    for source in (getattr(served.model, "generation_config", None), served.model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(v for v in value if isinstance(v, int))
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = getattr(served.model.config, "pad_token_id", None)
    if pad is None:
        pad = min(eos) if eos else 0
    return eos, int(pad)
