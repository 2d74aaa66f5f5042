"""What each replica holds, read back from the replica, never assumed from what the gateway did.

The gateway stamps every answer with the version it serves, so it must know that every replica
it sends a request to holds that version. Engines get restarted by whoever runs them (on their
launch weights), keep cached weights, or ignore a reload; the gateway's memory of what it loaded
says nothing about any of that. Two readings, taken from the replica itself:

- **label**: an engine that names its weights (SGLang's ``weight_version``, which the gateway sets
  to the rebuilt folder's name on every reload) is asked for it at every health probe, and every
  answer carries it too, so an answer from other weights is caught before it is stamped;
- **fingerprint**: the greedy logprobs of a fixed prompt (``PROBE_PROMPT``), measured on the
  replica right after its switch; an engine that names nothing (vLLM) is asked again at every
  health probe, and answers further than ``tolerance`` from that measurement mean other weights.

A replica that stops answering (a failed probe, a request it did not answer) takes no request
until it answers again AND holds the served version. One found on other weights is put back on
the served version (reloaded in place; restarted when that fails and the gateway supervises it) and checked
again; until then, and when that fails, it is ERROR with the reason. The probe runs every
``monitor_interval_s`` (``posttrain serve --probe-interval``), so a replica is restored or
reported ERROR within one interval of answering again. A replica that answered no request since its last
reading is only asked /health until ``idle_interval_s`` (``--idle-probe-interval``) has passed: every
reading is a request its engine's worker serves, and vLLM's worker spins a second after each one.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from posttrain import redact
from posttrain.serve.engine import EngineCallError, EngineError
from posttrain.serve.readback import ReplicaReadback
from posttrain.serve.replica import Replica

if TYPE_CHECKING:
    from pathlib import Path

log = redact.logger(__name__)

PROBE_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids every vocabulary has: the weights' fingerprint
# Max |logprob difference| between two fingerprints of the same weights on the same replica: what
# batching with other requests moves (float32 on CPU: below 1e-5; half precision: up to ~1e-2).
FINGERPRINT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2}
DEFAULT_FINGERPRINT_TOLERANCE = 5e-2


def distance(a: list[float], b: list[float]) -> float:
    """Largest |difference| of two fingerprints; infinite when they have other lengths (other tokens) or
    either holds NaN or an infinity (a NaN difference compares below every tolerance: it would pass)."""
    if len(a) != len(b) or not all(math.isfinite(x) for x in (*a, *b)):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def read_label(r: Replica) -> str | None:
    """The weight version the engine reports now (``EngineClient.weight_version``), None if it names none."""
    reader = getattr(r.client, "weight_version", None)
    return reader() if reader is not None else None


def _logprob(value: object) -> float | None:
    """A logprob as vLLM writes it in ``prompt_logprobs``: a number, or an object with ``logprob``."""
    if isinstance(value, dict):
        value = value.get("logprob")
    return float(value) if isinstance(value, (int, float)) else None


class ReplicaChecks(ReplicaReadback):
    """The reading and restoring half of ``RemoteEngine`` (it supplies the attributes used here)."""

    replicas: list[Replica]
    kind: str
    tolerance: float
    _adapter: str | None
    _base_dir: Path
    _closed: threading.Event
    _wake: threading.Event

    # ------------------------------------------------------------------ readings
    def _fingerprint(self, r: Replica, model: str | None = None) -> list[float]:
        """Greedy logprobs of a fixed prompt: what this replica's weights answer (and that it answers);
        ``model``: the engines' name to ask (default: what requests go to now)."""
        body = {"model": model or self._adapter or self.model_name, "prompt": PROBE_PROMPT, "max_tokens": 2,
                "temperature": 0.0, "logprobs": 1, "prompt_logprobs": 1}
        reply = r.client.complete(body)
        choice = reply["choices"][0]
        prompt = [_logprob(next(iter(d.values()))) for d in choice.get("prompt_logprobs") or []
                  if isinstance(d, dict) and d]
        return [x for x in prompt if x is not None] + [float(x) for x in choice["logprobs"]["token_logprobs"]]

    def _other_weights(self, r: Replica) -> str | None:
        """Why ``r`` does not hold the served version, read from ``r`` now; None when it does."""
        why = self._held_differs(r, self._base_dir)
        if why is not None:
            return why
        label = read_label(r)
        if label is not None or r.label is not None:
            if label != r.label:
                return f"it reports weight version {label!r}, not {r.label!r} ({self._served_name()})"
            return None
        if r.expected is None:
            return None
        gap = distance(self._fingerprint(r), r.expected)
        if gap > self.tolerance:
            return (f"its answers to the probe prompt are {gap:.3g} away from {self._served_name()}'s "
                    f"(tolerance {self.tolerance:g})")
        return None

    def _took(self, r: Replica, folder: Path, model: str | None = None, consumed: dict | None = None) -> None:
        """After ``r`` switched to ``folder``: read back and record what it holds (digests; ``consumed``: what
        its loader read, when the reload reported it), reports and answers (asking ``model``, default what
        requests go to now)."""
        label = read_label(r)
        if label is not None and label != folder.name:
            raise EngineError(f"{r.name} reports weight version {label!r} after reloading {folder.name}: it did "
                              "not take the new weights")
        self._read_back(r, folder, consumed)
        r.label, r.expected = label, self._fingerprint(r, model)
        r.answered, r.read_at = 0, time.monotonic()  # just read back: the monitor's clock starts again

    # ------------------------------------------------------------------ the monitor
    def _suspect(self, r: Replica, why: str) -> None:
        """Take no request to ``r`` until the monitor has read what it holds (at once: it is woken)."""
        if r.error is None:
            r.error = f"{why}; checking what it holds"
            log.warning("%s: %s", r.name, r.error)
        self._wake.set()

    def _watch(self, interval: float) -> None:
        """Every ``interval`` (or when woken): each replica alive, answering, and on the served version."""
        while not self._closed.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            for r in self.replicas:
                if self._closed.is_set():
                    return
                if not r.lock.acquire(blocking=False):
                    continue  # a replica being switched or restored is not watched meanwhile
                try:
                    self._check(r)
                except Exception as e:  # noqa: BLE001 - the monitor never dies; the replica reports it
                    r.error = f"checking it failed: {type(e).__name__}: {e}"
                    log.warning("%s: %s", r.name, r.error)
                finally:
                    r.lock.release()

    def _check(self, r: Replica) -> None:
        """One probe of ``r`` (the caller holds ``r.lock``)."""
        if r.process is not None and not r.process.alive():
            self._revive(r)
            return
        if not r.client.health():
            if r.error is None:
                r.error = ("it does not answer its health probe" + (
                    "; whoever runs it must restart it" if r.process is None else ""))
                log.warning("%s: %s", r.name, r.error)
            return
        idle = self.idle_interval_s
        if r.error is None and not r.answered and idle is not None and time.monotonic() - r.read_at < idle:
            return  # nothing answered since the last readback: the next one comes within idle_interval_s
        r.answered, r.read_at = 0, time.monotonic()
        try:
            why = self._other_weights(r)
        except EngineCallError as e:
            if r.error is None:
                r.error = f"it answers its health probe but not a completion ({e})"
                log.warning("%s: %s", r.name, r.error)
            return
        if why is None:
            if r.error is not None:
                log.info("%s holds %s and serves again", r.name, self._served_name())
            r.error = None
            return
        before = r.error
        # a replica that cannot be put back is tried again at every probe: logged once, not every interval
        (log.debug if before is not None and before.startswith(why) else log.warning)(
            "%s: %s; putting it back on %s", r.name, why, self._served_name())
        r.error = f"{why}; putting it back on {self._served_name()}"
        self._put_back(r, why, quiet=before)

    def _put_back(self, r: Replica, why: str, quiet: str | None = None) -> None:
        """Put ``r`` back on the served version and check it (the caller holds ``r.lock``): reloaded in place
        when the engine can take it (seconds); a supervised engine whose reload fails, or leaves it on other
        weights, is restarted (a minute for vLLM). A failure whose reason is ``quiet`` (the one logged at
        the last probe) is not logged again."""
        try:
            if not self._restart_needed(self._base_dir):
                try:
                    self._restore_checked(r, restart=False)
                    return
                except (EngineCallError, EngineError) as e:
                    if r.process is None:
                        raise
                    log.warning("%s: reloading %s in place did not put it back (%s); restarting it", r.name,
                                self._base_dir.name, e)
            elif r.process is None:
                raise EngineError(f"{self._base_dir.name} cannot be reloaded in place into {self.kind} (tied "
                                  f"embeddings): restart it on {self._base_dir}")
            self._restore_checked(r, restart=True)
        except Exception as e:  # noqa: BLE001 - reported as the replica's state
            r.error = f"{why}; putting it back on {self._served_name()} failed: {e}"
            if r.error != quiet:
                log.warning("%s: %s", r.name, r.error)

    def _restore_checked(self, r: Replica, restart: bool) -> None:
        """Switch ``r`` to the served folder (in place, or by restarting its engine) and read back that it
        holds it; an ``EngineError`` when it does not."""
        consumed = None
        if restart:
            r.process.restart(self._base_dir)
        else:
            consumed = self._switch(r, self._base_dir, restart=False)
        self._reattach(r)
        self._read_back(r, self._base_dir, consumed)
        self._check_probe(r, self._base_dir, None)
        label = read_label(r)
        if label is not None and r.label is not None:
            r.label = self._base_dir.name  # a reload names the weights after the folder
        again = self._other_weights(r)
        if again is not None:
            raise EngineError(again)
        r.error = None
        log.info("%s is back on %s", r.name, self._served_name())

    def _revive(self, r: Replica) -> None:
        """Restart a supervised engine that died on the version served now (the caller holds ``r.lock``)."""
        r.restarting = True
        r.error = f"the engine died; restarting it on {self._served_name()}"
        log.warning("%s: %s", r.name, r.error)
        try:
            r.process.restart(self._base_dir)
            self._reattach(r)
            self._read_back(r, self._base_dir, None)
            self._check_probe(r, self._base_dir, None)
            why = self._other_weights(r)
            if why is not None:
                raise EngineError(why)
            r.error = None
            log.info("%s serves again", r.name)
        except Exception as e:  # noqa: BLE001 - reported as the replica's state
            r.error = f"the engine died and did not come back on {self._served_name()}: {e}"
        finally:
            r.restarting = False

    def verify(self) -> None:
        """Check every replica now (a hot-load of the version served asks this): put back those on other
        weights; raise ``EngineError`` naming those that cannot serve it."""
        for r in self.replicas:
            with r.lock:
                self._check(r)
        errors = {r.name: r.error for r in self.replicas if r.error is not None}
        if errors:
            raise EngineError("; ".join(f"{name}: {why}" for name, why in errors.items()))
