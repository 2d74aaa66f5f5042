"""An engine in other processes behind the gateway (vLLM, SGLang): safe, versioned hot-loads.

Engines that reload weights from a folder do not do it safely on their own
(shared/research/vllm-cpu.md): vLLM reloads a folder missing a tensor with HTTP 200 into a
silent mix of two versions, a wrong shape leaves it broken until restarted, and with tied
embeddings its CPU build keeps the old LM head. So a hot-load here:

1. checks the rebuilt folder's tensor names, dtypes and shapes against the served model's
   before the engine sees it (``checks.check_layout``);
2. holds new requests back and waits for those in flight (``checks.Gate``, and the engine's own
   pause), so every answer is stamped with the version that made it;
3. switches each replica: in place (pause, reload, resume), or by restarting the engine on the
   new folder where in place cannot be trusted, then checks that it answers and that its answers
   changed (``_fingerprint``);
4. on any failure puts every replica back on the previous version (restarting an engine that a
   failed reload broke) and raises, so the previous version is still served.

A LoRA adapter published alone (a packed adapter folder, ``lora.packed``) is loaded on top of the
base the engines hold, when the engine kind loads adapters at run time (``max_lora_rank``: vLLM's
``/v1/load_lora_adapter``): checked first (``adapters``: rank, base fingerprint), loaded into each
replica under its snapshot identity, probed, and only then are requests for the model routed to
it and the previous adapter unloaded; a failure unloads it again, leaving the previous version.

A replica is an engine server this gateway started and supervises (an ``EngineProcess``:
restarted on the served version when it dies, reported ERROR until then), or one at a URL that
someone else runs (reported ERROR while it does not answer its health probe). Engine kinds plug in an ``EngineClient`` (``vllm.client``, ``sglang``).
"""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import redact
from posttrain.chain.checkpoint import CONFIG_NAME, INDEX_NAME
from posttrain.lora.packed import is_packed_adapter
from posttrain.serve.adapters import PEFT_DIR, BaseCheck, refuse_adapters, unpacked
from posttrain.serve.checks import Gate, Layout, check_layout, folder_layout, same_weights, ties_embeddings
from posttrain.serve.completions import RequestError, check_request_size
from posttrain.serve.engine import EngineCallError, EngineClient, EngineError, EngineProcess, Served
from posttrain.serve.model_slot import recorded_version

log = redact.logger(__name__)  # every record scrubbed (S3 credentials, URL userinfo)

PROBE_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids every vocabulary has: the weights' fingerprint
RESTART_WAIT_S = 600.0


@dataclass
class Replica:
    name: str
    client: EngineClient
    process: EngineProcess | None = None  # a server this gateway supervises, or None for one at a URL
    error: str | None = None  # why it does not serve; None when it does
    restarting: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class RemoteEngine:
    def __init__(self, *, kind: str, model_dir: Path, model_name: str, replicas: list[Replica],
                 reload: str = "auto", restart_when_tied: bool = False, monitor_interval_s: float = 2.0,
                 max_request_tokens: int | None = None, max_lora_rank: int | None = None):
        """``reload``: in-place, restart, or auto (restart when ``restart_when_tied`` and the model ties
        its embeddings: an engine kind whose in-place reload gets that wrong). ``max_lora_rank``: the
        replicas load LoRA adapters at run time up to this rank; None refuses adapters."""
        if not replicas:
            raise ValueError(f"the {kind} engine needs at least one replica")
        self.kind = kind
        self.max_request_tokens = max_request_tokens  # prompts x n x max_tokens one request may ask for
        self.restart_when_tied = restart_when_tied
        self.model_name = model_name
        self.replicas = replicas
        self.replica_names = [r.name for r in replicas]
        self.reload_mode = reload
        self.boot_dir = model_dir
        self.layout: Layout = folder_layout(model_dir)
        self.max_positions = _max_positions(model_dir)
        self._served = Served(recorded_version(model_dir), model_dir)
        self.max_lora_rank = max_lora_rank
        self._base_dir = model_dir  # the model folder the engines hold; an adapter is served on top of it
        self._adapter: str | None = None  # the engines' name of the adapter requests go to; None: the base
        self._base_check = BaseCheck(model_dir)
        self._gate = Gate()
        self._turn = itertools.count()
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, args=(monitor_interval_s,), name=f"{kind}-monitor",
                                         daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ Engine
    def current(self) -> Served:
        return self._served

    def replica_errors(self) -> dict[str, str]:
        return {r.name: r.error for r in self.replicas if r.error is not None}

    def close(self) -> None:
        self._closed.set()
        for r in self.replicas:
            if r.process is not None:
                r.process.stop()
            r.client.close()

    def complete(self, body: object) -> dict:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        if body.get("model") != self.model_name:
            raise RequestError(404, f"model {body.get('model')!r} does not exist; this deployment serves "
                                    f"{self.model_name!r}", "model", kind="NotFoundError")
        check_request_size(body, self.max_request_tokens)  # the engine would take any: the gateway bounds it
        with self._gate.shared():
            served = self._served
            replica = self._pick()
            try:
                reply = replica.client.complete({**body, "model": self._adapter or self.model_name})
            except EngineCallError as e:
                if e.status == 0:
                    raise RequestError(503, f"{replica.name} did not answer ({e})",
                                       kind="ServiceUnavailableError") from None
                status = e.status if e.status and 400 <= e.status < 600 else 502
                raise RequestError(status, f"{replica.name}: {e}") from None
        reply["model"] = self.model_name
        reply["snapshot_identity"] = served.identity  # which weights sampled these: the rollout's policy version
        return reply

    def load(self, folder: Path, identity: str) -> Served:
        if is_packed_adapter(folder):
            return self._load_adapter(folder, identity)
        check_layout(folder, self.layout)
        _add_model_files(folder, self.boot_dir)
        restart = self.reload_mode == "restart" or (
            self.reload_mode == "auto" and self.restart_when_tied and ties_embeddings(folder))
        self._wait_restarts()
        with self._gate.exclusive():
            previous, previous_base = self._served, self._base_dir
            switched: list[Replica] = []
            try:
                for r in self.replicas:
                    if r.error is not None:
                        raise EngineError(f"{r.name} is not serving ({r.error})")
                    switched.append(r)
                    with r.lock:  # the monitor leaves a replica alone while it is switched
                        before = self._fingerprint(r, self.model_name)
                        self._switch(r, folder, restart)
                        if self._fingerprint(r, self.model_name) == before and not same_weights(folder, previous_base):
                            raise EngineError(f"{r.name} answers exactly as before reloading {folder.name}: it did "
                                              "not take the new weights")
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

    def _load_adapter(self, folder: Path, identity: str) -> Served:
        if self.max_lora_rank is None:
            raise refuse_adapters(self.kind, folder)
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
                        r.client.load_adapter(identity, folder / PEFT_DIR)
                        self._fingerprint(r, identity)  # it answers with the adapter
            except Exception as e:
                log.warning("hot-load of adapter %s failed (%s); unloading it from %d replica(s), still serving %s",
                            identity, e, len(loaded), self._served.identity or "the boot weights")
                self._drop_adapter(identity, loaded)
                raise
            self._served, self._adapter = Served(identity, folder, base=self._base_dir), identity
            self._drop_adapter(old)
        return self._served

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
        """After ``r`` restarted on the base: load the adapter requests go to again."""
        if self._adapter is not None:
            r.client.load_adapter(self._adapter, self._served.path / PEFT_DIR)

    # ------------------------------------------------------------------ switching
    def _switch(self, r: Replica, folder: Path, restart: bool) -> None:
        if restart:
            if r.process is None:
                raise EngineError(f"{r.name}: cannot restart an engine someone else runs ({self.kind} at a URL); "
                                  f"{folder / CONFIG_NAME} ties the LM head to the embeddings, which {self.kind} does "
                                  "not reload in place correctly: let the gateway start the engine (no --engine-url)")
            r.process.restart(folder)
            return
        r.client.pause()
        try:
            r.client.reload(folder)
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
                    self._switch(r, folder, restart=False)
                    self._fingerprint(r)
                    return
            except EngineCallError as e:
                log.warning("%s: reloading the previous weights failed (%s); restarting it", r.name, e)
            if r.process is None:
                r.error = "a failed reload left this engine unable to serve; restart it"
                return
            try:
                r.process.restart(folder)
                self._reattach(r)
                r.error = None
            except Exception as e:  # noqa: BLE001 - reported as the replica's state
                r.error = f"restart on the previous weights failed: {e}"

    def _fingerprint(self, r: Replica, model: str | None = None) -> list[float]:
        """Greedy logprobs of a fixed prompt: what this replica's weights answer (and that it answers);
        ``model``: the engines' name to ask (default: what requests go to now)."""
        body = {"model": model or self._adapter or self.model_name, "prompt": PROBE_PROMPT, "max_tokens": 2, "temperature": 0.0,
                "logprobs": 1, "prompt_logprobs": 1}
        reply = r.client.complete(body)
        choice = reply["choices"][0]
        prompt = [_logprob(next(iter(d.values()))) for d in choice.get("prompt_logprobs") or [] if isinstance(d, dict) and d]
        return [x for x in prompt if x is not None] + [float(x) for x in choice["logprobs"]["token_logprobs"]]

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

    def _watch(self, interval: float) -> None:
        """Restart a supervised engine that died, on the version served now; ERROR until it is back.
        A replica at a URL is ERROR while it does not answer its health probe."""
        while not self._closed.wait(interval):
            for r in self.replicas:
                if r.process is None and not self._closed.is_set():
                    self._probe(r)
                if r.process is None or self._closed.is_set() or not r.lock.acquire(blocking=False):
                    continue  # a replica being switched or restored is not watched meanwhile
                try:
                    if not r.process.alive():
                        self._revive(r)
                finally:
                    r.lock.release()

    def _revive(self, r: Replica) -> None:
        """Restart a supervised engine that died on the version served now (the caller holds ``r.lock``)."""
        r.restarting = True
        r.error = f"the engine died; restarting it on {self._served.identity or 'the boot weights'}"
        log.warning("%s: %s", r.name, r.error)
        try:
            r.process.restart(self._base_dir)
            self._reattach(r)
            r.error = None
            log.info("%s serves again", r.name)
        except Exception as e:  # noqa: BLE001 - reported as the replica's state
            r.error = f"the engine died and did not restart: {e}"
        finally:
            r.restarting = False

    def _probe(self, r: Replica) -> None:
        unreachable = f"{self.kind} at a URL does not answer its health probe; whoever runs it must restart it"
        healthy = r.client.health()
        if not healthy and r.error is None:
            r.error = unreachable
            log.warning("%s: %s", r.name, r.error)
        elif healthy and r.error == unreachable:  # other errors (a failed restore) stay
            r.error = None
            log.info("%s answers again", r.name)


def _add_model_files(folder: Path, boot_dir: Path) -> None:
    """Give a rebuilt folder (weights and config.json) the boot folder's other files (tokenizer,
    generation config), so an engine restarted on it starts the same way it booted."""
    for src in boot_dir.iterdir():
        if src.is_file() and src.suffix != ".safetensors" and src.name != INDEX_NAME and not (folder / src.name).exists():
            shutil.copy2(src, folder / src.name)


def _logprob(value: object) -> float | None:
    """A logprob as vLLM writes it in ``prompt_logprobs``: a number, or an object with ``logprob``."""
    if isinstance(value, dict):
        value = value.get("logprob")
    return float(value) if isinstance(value, (int, float)) else None


def _max_positions(model_dir: Path) -> int | None:
    import json

    try:
        config = json.loads((model_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) else None
