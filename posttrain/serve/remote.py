"""An engine in other processes behind the gateway (vLLM, SGLang): safe, versioned hot-loads.

Engines that reload weights from a folder do not do it safely on their own
(docs/gateway.md): vLLM reloads a folder missing a tensor with HTTP 200 into a
silent mix of two versions, a wrong shape leaves it broken until restarted, and with tied
embeddings its CPU build keeps the old LM head. So a hot-load here:

1. checks the rebuilt folder's tensor names, dtypes and shapes against the served model's
   before the engine sees it (``checks.check_layout``);
2. holds new requests back and waits for those in flight (``checks.Gate``, and the engine's own
   pause), so every answer is stamped with the version that made it;
3. switches each replica: in place (pause, reload, resume), or by restarting the engine on the
   new folder where in place cannot be trusted, then reads back what it holds (``holding``: the
   weight version it reports, its answers to a fixed prompt, which must have changed) and checks
   its answers against the probe the trainer stored with the snapshot (``probe``), when there is one;
4. on any failure puts every replica back on the previous version (restarting an engine that a
   failed reload broke) and raises, so the previous version is still served.

A LoRA adapter published alone (a packed adapter folder, ``lora.packed``) is loaded on top of the
base the engines hold, when the engine kind loads adapters at run time (``max_lora_rank``: vLLM's
``/v1/load_lora_adapter``): checked first (``adapters``: rank, base fingerprint), loaded into each
replica under its snapshot identity, probed, and only then are requests for the model routed to
it and the previous adapter unloaded; a failure unloads it again, leaving the previous version.

A replica is an engine server this gateway started and supervises (an ``EngineProcess``:
restarted on the served version when it dies), or one at a URL that someone else runs. Either way
the gateway reads back at every health probe what the replica holds (``holding``), puts one found
on other weights back on the served version, and sends it no request until it holds that version.
Engine kinds plug in an ``EngineClient`` (``vllm.client``, ``sglang``).
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
from pathlib import Path

from posttrain import redact
from posttrain.chain.checkpoint import CONFIG_NAME, INDEX_NAME
from posttrain.lora.packed import is_packed_adapter
from posttrain.serve.adapters import PEFT_DIR, BaseCheck, refuse_adapters, unpacked
from posttrain.serve.checks import Gate, Layout, check_layout, folder_layout, same_weights, ties_embeddings
from posttrain.serve.completions import ACCEPTED, RequestError, parse_request
from posttrain.serve.engine import EngineCallError, EngineError, Served
from posttrain.serve.holding import DEFAULT_FINGERPRINT_TOLERANCE, Replica, ReplicaChecks, read_label
from posttrain.serve.model_slot import recorded_version
from posttrain.serve.probe import completions_body, judge_folder, parse_prompt_logprobs
from posttrain.serve.readback import reads_back
from posttrain.serve.stages import stage

log = redact.logger(__name__)  # every record scrubbed (S3 credentials, URL userinfo)

RESTART_WAIT_S = 600.0
NO_LIMIT = 1 << 31

__all__ = ["RemoteEngine", "Replica"]


class RemoteEngine(ReplicaChecks):
    def __init__(self, *, kind: str, model_dir: Path, model_name: str, replicas: list[Replica],
                 reload: str = "auto", restart_when_tied: bool = False, monitor_interval_s: float = 2.0,
                 idle_interval_s: float | None = None,
                 max_request_tokens: int | None = None, max_lora_rank: int | None = None,
                 max_tokens_limit: int = NO_LIMIT, max_n: int = NO_LIMIT,
                 tolerance: float = DEFAULT_FINGERPRINT_TOLERANCE, engine_dtype: str | None = None):
        """``reload``: in-place, restart, or auto (restart when ``restart_when_tied`` and the model ties
        its embeddings: an engine kind whose in-place reload gets that wrong). ``max_lora_rank``: the
        replicas load LoRA adapters at run time up to this rank; None refuses adapters. The request
        limits are the reference server's (``completions.parse_request``); ``tolerance``: how far a
        replica's answers to the probe prompt may move while it holds the same weights (``holding``);
        ``engine_dtype``: the dtype the engines compute in, when known (a coarser one than the weights'
        widens the snapshot probe's tolerance)."""
        if not replicas:
            raise ValueError(f"the {kind} engine needs at least one replica")
        self.kind = kind
        self.max_request_tokens = max_request_tokens  # n x (prompt + max_tokens) one request may ask for
        self.max_tokens_limit, self.max_n = max_tokens_limit, max_n
        self.restart_when_tied = restart_when_tied
        self.model_name = model_name
        self.replicas = replicas
        self.replica_names = [r.name for r in replicas]
        self.reload_mode = reload
        self.tolerance, self.engine_dtype = tolerance, engine_dtype
        self.boot_dir = model_dir
        self.layout: Layout = folder_layout(model_dir)
        self.max_positions, self.vocab_size = _model_limits(model_dir)
        self._served = Served(recorded_version(model_dir), model_dir)
        self.max_lora_rank = max_lora_rank
        self._base_dir = model_dir  # the model folder the engines hold; an adapter is served on top of it
        self._adapter: str | None = None  # the engines' name of the adapter requests go to; None: the base
        self._base_check = BaseCheck(model_dir)
        self._gate = Gate()
        self._turn = itertools.count()
        self._closed = threading.Event()
        self._wake = threading.Event()
        for r in replicas:  # what each holds at start: what later readings are compared with
            try:
                r.label, r.expected, r.read_at = read_label(r), self._fingerprint(r), time.monotonic()
                self._learn_layout(r, model_dir)
                why = self._held_differs(r, model_dir, first=True)
                if why is not None:  # a restarted gateway's replicas may hold its recorded version: resume decides
                    log.info("%s does not hold the boot weights %s (%s)", r.name, model_dir, why)
            except EngineCallError as e:
                r.error = f"it did not answer a completion at start ({e})"
        self.idle_interval_s = idle_interval_s  # read back an idle replica this often (None: every probe)
        self._monitor = threading.Thread(target=self._watch, args=(monitor_interval_s,), name=f"{kind}-monitor",
                                         daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ Engine
    def current(self) -> Served:
        return self._served

    def _served_name(self) -> str:
        return self._served.identity or "the boot weights"

    def replica_errors(self) -> dict[str, str]:
        return {r.name: r.error for r in self.replicas if r.error is not None}

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        for r in self.replicas:
            if r.process is not None:
                r.process.close()  # not stop(): the monitor may be restarting it this very moment
            r.client.close()

    def complete(self, body: object) -> dict:
        # the reference server's checks exactly: the engine would take fields the contract forbids
        parse_request(body, model_name=self.model_name, vocab_size=self.vocab_size, max_positions=self.max_positions,
                      max_tokens_limit=self.max_tokens_limit, max_n=self.max_n,
                      max_request_tokens=self.max_request_tokens)
        forwarded = {k: v for k, v in body.items() if k in ACCEPTED and v is not None}
        with self._gate.shared():
            served = self._served
            for _ in range(len(self.replicas)):
                replica = self._pick()
                try:
                    reply = replica.client.complete({**forwarded, "model": self._adapter or self.model_name})
                except EngineCallError as e:
                    if e.status == 0:
                        self._suspect(replica, "it did not answer a request")
                        raise RequestError(503, f"{replica.name} did not answer ({e})",
                                           kind="ServiceUnavailableError") from None
                    if e.status >= 500:  # the engine failing (restarting, crashed): the replica is checked again
                        self._suspect(replica, f"it failed a request ({e.status})")
                        raise RequestError(503, f"{replica.name}: {e}", kind="ServiceUnavailableError") from None
                    status = e.status if e.status and 400 <= e.status < 600 else 502
                    raise RequestError(status, f"{replica.name}: {e}") from None
                replica.answered += 1  # read back at the next probe (holding: idle replicas less often)
                label = reply.get("weight_version")
                if replica.label is None or label is None or label == replica.label:
                    break
                # answered by weights other than those stamped: never returned; another replica is asked
                self._suspect(replica, f"it answered with weight version {label!r}, not {replica.label!r}")
            else:
                raise RequestError(503, "no replica answered with the served version; try again",
                                   kind="ServiceUnavailableError")
        reply["model"] = self.model_name
        reply["snapshot_identity"] = served.identity  # which weights sampled these: the rollout's policy version
        return reply

    def load(self, folder: Path, identity: str, *, resume: bool = False) -> Served:
        """Switch every replica to ``folder``. ``resume``: a restarted gateway putting back the version it
        recorded; a replica that already holds it (its reported weight version, or its answers to the
        snapshot's probe) is adopted as it is, and answers need not have changed."""
        if is_packed_adapter(folder):
            return self._load_adapter(folder, identity)
        with stage("validate"):
            check_layout(folder, self.layout)
        _add_model_files(folder, self.boot_dir)
        restart = self._restart_needed(folder)
        if self.reload_mode == "in-place" and self.restart_when_tied and ties_embeddings(folder):
            # measured on vLLM's CPU build: replies then match neither version while every digest it can
            # read is right (its LM head is a copy the reload does not refresh); refused before any replica
            raise EngineError(f"{folder / CONFIG_NAME} ties the LM head to the embeddings, which {self.kind} does "
                              "not reload in place correctly: use --reload auto or restart")
        if restart:  # refused before any replica is touched: every one keeps serving
            elsewhere = [r.name for r in self.replicas if r.process is None]
            if elsewhere:
                raise EngineError(
                    f"{', '.join(elsewhere)}: cannot restart an engine someone else runs ({self.kind} at a URL); "
                    f"{folder / CONFIG_NAME} ties the LM head to the embeddings, which {self.kind} does not reload "
                    "in place correctly: let the gateway start the engine (no --engine-url)")
        self._wait_restarts()
        with self._gate.exclusive():
            previous, previous_base = self._served, self._base_dir
            switched: list[Replica] = []
            try:
                for r in self.replicas:
                    if r.error is not None:
                        raise EngineError(f"{r.name} is not serving ({r.error})")
                    with r.lock:  # the monitor leaves a replica alone while it is switched
                        if resume and self._holds_already(r, folder):
                            log.info("%s holds %s already: adopted as it is", r.name, identity)
                            continue
                        switched.append(r)
                        with stage("switch"):
                            # The base model's answers, before and after: an adapter served until now is
                            # dropped once every replica switched, so requests go to the new weights
                            # themselves (recorded with the adapter's answers, the monitor found them
                            # "other weights" at its next probe and put the replica back)
                            before = None if resume else self._fingerprint(r, self.model_name)
                            consumed = self._switch(r, folder, restart)
                            self._took(r, folder, self.model_name, consumed)
                            if (before is not None and r.expected == before
                                    and not same_weights(folder, previous_base)):
                                raise EngineError(f"{r.name} answers exactly as before reloading {folder.name}: it "
                                                  "did not take the new weights")
                        with stage("probe"):
                            self._check_probe(r, folder, previous_base)
            except Exception as e:
                log.warning("hot-load of %s failed (%s); putting %d replica(s) back on %s", identity, e,
                            len(switched), previous.identity or "the boot weights")
                for r in switched:
                    self._restore(r, previous_base, restart)
                raise
            self._served, self._base_dir = Served(identity, folder), folder
            if not restart:  # a restarted engine has no adapter left to unload
                self._drop_adapter(self._adapter)  # requests go to the new weights themselves now
            self._adapter = None
        return self._served

    def resume(self, folder: Path, identity: str) -> Served:
        return self.load(folder, identity, resume=True)

    def _holds_already(self, r: Replica, folder: Path) -> bool:
        """Whether ``r`` holds ``folder``'s weights now, read from ``r``: the weight version it reports, or
        its answers to the probe stored with the snapshot. Without either, it cannot be known: False."""
        label = read_label(r)
        if label is not None and label != folder.name:
            return False
        digests = reads_back(r) and bool(r.readback)
        if digests and self._held_differs(r, folder, first=True) is not None:
            return False
        try:
            if not self._check_probe(r, folder, None) and label is None and not digests:
                return False
        except EngineError:
            return False
        r.label, r.expected = label, self._fingerprint(r)
        return True

    def _check_probe(self, r: Replica, folder: Path, previous: Path | None) -> bool:
        """Check ``r``'s answers against the probe the trainer stored in ``folder`` (``probe``: the expected
        answers of fixed prompts, computed on the weights it saved), and, when ``previous`` has one, that
        they are closer to this version's than to the previous one's. True when checked, False when
        ``folder`` has no probe (another producer's snapshot: the other checks stand alone)."""
        verdict = judge_folder(lambda sequence: self._score(r, sequence), folder, previous,
                               engine_dtype=self.engine_dtype)
        if verdict is None:
            return False
        if not verdict.ok:
            raise EngineError(f"{r.name}: {verdict.reason}")
        log.info("%s: probe of %s: %s", r.name, folder.name, verdict.reason)
        return True

    def _score(self, r: Replica, sequence: tuple[list[int], int]) -> list[float]:
        """``r``'s teacher-forced logprobs of a probe sequence's completion tokens (prompt logprobs)."""
        ids, start = sequence
        return parse_prompt_logprobs(r.client.complete(completions_body(self.model_name, sequence)), start, ids)

    def _restart_needed(self, folder: Path) -> bool:
        return self.reload_mode == "restart" or (
            self.reload_mode == "auto" and self.restart_when_tied and ties_embeddings(folder))

    def _load_adapter(self, folder: Path, identity: str) -> Served:
        if self.max_lora_rank is None:
            raise refuse_adapters(self.kind, folder)
        with stage("validate"):
            _, base = unpacked(folder, identity, self.max_lora_rank)
            self._base_check.check(base, self._base_dir, identity)
        self._wait_restarts()
        with self._gate.exclusive():
            old, loaded = self._adapter, []
            try:
                for r in self.replicas:
                    if r.error is not None:
                        raise EngineError(f"{r.name} is not serving ({r.error})")
                    with r.lock:
                        loaded.append(r)
                        with stage("switch"):
                            r.client.load_adapter(identity, folder / PEFT_DIR)
                            r.expected = self._fingerprint(r, identity)  # it answers with the adapter
            except Exception as e:
                log.warning("hot-load of adapter %s failed (%s); unloading it from %d replica(s), still serving %s",
                            identity, e, len(loaded), self._served.identity or "the boot weights")
                self._drop_adapter(identity, loaded)
                for r in loaded:
                    r.expected = self._fingerprint_or_none(r)
                raise
            self._served, self._adapter = Served(identity, folder, base=self._base_dir), identity
            self._drop_adapter(old)
        return self._served

    def _fingerprint_or_none(self, r: Replica) -> list[float] | None:
        try:
            return self._fingerprint(r)
        except EngineCallError:
            return None

    def _drop_adapter(self, name: str | None, replicas: list[Replica] | None = None) -> None:
        """Unload adapter ``name`` where it is loaded; one that will not unload only costs a LoRA slot."""
        if name is None:
            return
        for r in self.replicas if replicas is None else replicas:
            try:
                r.client.unload_adapter(name)
            except EngineCallError as e:
                log.warning("%s: unloading adapter %s failed (%s)", r.name, name, e)

    def _reattach(self, r: Replica) -> None:
        """After ``r`` restarted or was put back on the base: load the adapter requests go to again, unless it
        still serves it (an engine reloaded in place keeps its adapters)."""
        if self._adapter is not None and self._adapter not in getattr(r.client, "served_models", list)():
            r.client.load_adapter(self._adapter, self._served.path / PEFT_DIR)

    # ------------------------------------------------------------------ switching
    def _switch(self, r: Replica, folder: Path, restart: bool) -> dict | None:
        """Switch ``r`` to ``folder``; the tensors its loader read, when its engine reports them."""
        if restart:
            r.process.restart(folder)  # load() refused replicas at a URL before touching any
            return None
        r.client.pause()
        try:
            return r.client.reload(folder)
        finally:
            try:
                r.client.resume()
            except EngineCallError:
                pass  # a reload that broke the engine: the restore below restarts it

    def _restore(self, r: Replica, folder: Path, restart: bool) -> None:
        """Put ``r`` back on ``folder``: reload in place when it still works, else restart it."""
        with r.lock:
            try:
                if not restart:
                    self._took(r, folder, consumed=self._switch(r, folder, restart=False))
                    return
            except (EngineCallError, EngineError) as e:
                log.warning("%s: reloading the previous weights failed (%s); restarting it", r.name, e)
            if r.process is None:
                r.error = "a failed reload left this engine unable to serve; restart it"
                return
            try:
                r.process.restart(folder)
                self._reattach(r)
                self._took(r, folder)
                r.error = None
            except Exception as e:  # noqa: BLE001 - reported as the replica's state
                r.error = f"restart on the previous weights failed: {e}"

    # ------------------------------------------------------------------ replicas
    def _pick(self) -> Replica:
        ready = [r for r in self.replicas if r.error is None]
        if not ready:
            errors = "; ".join(f"{r.name}: {r.error}" for r in self.replicas)
            raise RequestError(503, f"no replica can serve ({errors})", kind="ServiceUnavailableError")
        return ready[next(self._turn) % len(ready)]

    def _wait_restarts(self) -> None:
        deadline = time.monotonic() + RESTART_WAIT_S
        while any(r.restarting for r in self.replicas) and time.monotonic() < deadline:
            time.sleep(0.5)


def _add_model_files(folder: Path, boot_dir: Path) -> None:
    """Give a rebuilt folder (weights and config.json) the boot folder's other files (tokenizer,
    generation config), so an engine restarted on it starts the same way it booted."""
    for src in boot_dir.iterdir():
        if src.is_file() and src.suffix != ".safetensors" and src.name != INDEX_NAME and not (folder / src.name).exists():
            shutil.copy2(src, folder / src.name)


def _model_limits(model_dir: Path) -> tuple[int | None, int]:
    """The model's context length (None when its config names none) and vocabulary size (no limit
    when it names none): the bounds the reference server checks prompts against."""
    try:
        config = json.loads((model_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, NO_LIMIT
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    positions = text.get("max_position_embeddings", config.get("max_position_embeddings"))
    vocab = text.get("vocab_size", config.get("vocab_size"))
    return (positions if isinstance(positions, int) else None), (vocab if isinstance(vocab, int) and vocab > 0
                                                                 else NO_LIMIT)
