"""The reference engine: a transformers causal LM served in this process (``--engine reference``).

Completions are sampled in one batch per request (``sampler``); a hot-load loads the rebuilt
folder beside the served model and swaps the reference (``model_slot``), so a request never
sees two versions and in-flight requests finish on the weights they began with.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from posttrain.lora.packed import is_packed_adapter
from posttrain.serve.adapters import refuse_adapters
from posttrain.serve.completions import build_response, parse_request
from posttrain.serve.engine import Served
from posttrain.serve.model_slot import ModelSlot, ServedModel, load_served, resolve_device
from posttrain.serve.probe import judge, read_probe, score_with_model
from posttrain.serve.sampler import sample
from posttrain.serve.stages import stage
from posttrain.serve.serve_config import ServeConfig

log = logging.getLogger(__name__)


class ReferenceEngine:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.model_name = config.served_model_name or config.model_dir.resolve().name
        self.tokenizer = _load_tokenizer(config.model_dir)
        boot = load_served(config.model_dir, self.device)
        self.slot = ModelSlot(boot)
        self.replica_names = [f"replica-{i:04d}" for i in range(config.replicas)]
        cfg = boot.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.eos_ids, self.pad_id = _special_ids(boot, self.tokenizer)
        self.generate_lock = threading.Lock()

    def current(self) -> Served:
        served = self.slot.current()
        return Served(served.identity, served.path)

    def load(self, folder: Path, identity: str) -> Served:
        """Load ``folder`` like the served model (same tensor names, shapes, dtypes), check it against
        the folder's probe, and swap it in; on failure the previous version keeps serving."""
        if is_packed_adapter(folder):
            raise refuse_adapters("reference", folder)
        with stage("switch"):  # loading beside the served model, then the swap below; validate: its layout
            new = load_served(folder, self.device, like=self.slot.current(), identity=identity)
        with stage("probe"):
            self._check_probe(new, self.slot.current())
        with stage("switch"):
            self.slot.swap(new)
        return Served(new.identity, new.path)

    def resume(self, folder: Path, identity: str) -> Served:
        return self.load(folder, identity)

    def verify(self) -> None:
        pass  # the model in this process is the one swapped in: nothing else can change it

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
        verdict = judge(scored, probe, scored_previous, previous, version=new.identity,
                        previous_version=before.identity, engine_dtype=dtype)
        if not verdict.ok:
            raise ValueError(verdict.reason)
        log.info("probe of %s: %s", new.identity, verdict.reason)

    def replica_errors(self) -> dict[str, str]:
        return {}  # one model in this process serves every replica

    def close(self) -> None:
        pass

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
            choices = sample(served.model, params.prompts, n=params.n, max_tokens=params.max_tokens,
                             temperature=params.temperature, top_p=params.top_p, eos_token_ids=self.eos_ids,
                             pad_token_id=self.pad_id, seed=params.seed,
                             max_batch_rows=self.config.max_batch_rows)
        return build_response(params, choices, model_name=self.model_name, snapshot_identity=served.identity,
                              decode=self.decode)


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
