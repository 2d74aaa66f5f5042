"""The digest half of what a replica holds: weights read back from inside the engine, compared bit for bit.

``holding`` reads what an engine says and answers; this reads what it holds. An engine client that
can (``read_held``: vLLM through its readback extension, SGLang through ``get_weights_by_name``)
reports digests of its parameters as they sit in memory, and, after an in-place reload, of every
tensor its loader handed to the model (``reload`` returns them). ``weight_digest`` says what they
must be, from the snapshot's own bytes. So after every switch, restart and put-back, and at every
health probe, a replica is on the served version only when:

- the tensors its loader read are exactly the snapshot's (none missing, none extra, none from a cache);
- its parameters whose layout is the checkpoint's (embeddings, norms, an untied LM head) are exactly
  the snapshot's, cast to the dtype the engine computes in; fused, repacked and quantized ones are
  covered by the loader's digests at a reload, not in memory (docs/gateway.md);
- it still reports the identity of its last verified reload (an engine restarted behind the
  gateway's back forgets it), and nothing holds NaN or infinity.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from posttrain import redact
from posttrain.chain.checkpoint import Checkpoint
from posttrain.serve.checks import ties_embeddings
from posttrain.serve.engine import EngineError
from posttrain.serve.replica import Replica
from posttrain.serve.weight_digest import (
    EMBEDDINGS,
    TIED_HEAD,
    Expected,
    HeldTensor,
    comparable,
    compare,
    consumed_expected,
    held_expected,
)

log = redact.logger(__name__)
CACHED_FOLDERS = 4  # expected digests kept: the served version, the one switched to, their bases


def reads_back(r: Replica) -> bool:
    """Whether ``r``'s engine reports digests of what it holds."""
    return hasattr(r.client, "read_held")


class ReplicaReadback:
    """Reading back digests (mixed into ``RemoteEngine`` through ``holding.ReplicaChecks``)."""

    replicas: list[Replica]
    _base_dir: Path

    def _expected(self, key: tuple, make) -> dict[str, Expected]:
        cache = self.__dict__.setdefault("_digest_cache", OrderedDict())
        lock = self.__dict__.setdefault("_digest_lock", threading.Lock())
        with lock:
            if key in cache:
                cache.move_to_end(key)
                return cache[key]
        value = make()
        with lock:
            cache[key] = value
            while len(cache) > CACHED_FOLDERS * 2:
                cache.popitem(last=False)
        return value

    def _learn_layout(self, r: Replica, folder: Path) -> None:
        """Which of ``r``'s parameters hold a checkpoint tensor as it is (read once per replica: the
        layout of a model does not change with its weights)."""
        if not reads_back(r):
            return
        names = list(Checkpoint.open(folder).tensors)
        if ties_embeddings(folder) and EMBEDDINGS in names:
            names.append(TIED_HEAD)
        r.readback = comparable(r.client.read_layout(names), folder)
        if not r.readback:
            log.warning("%s holds no parameter in the checkpoint's layout: only the tensors its loader reads "
                        "at a reload are compared by digest", r.name)

    def _read_back(self, r: Replica, folder: Path, consumed: dict[str, HeldTensor] | None) -> None:
        """Raise ``EngineError`` unless ``r`` holds exactly ``folder``'s weights, read from ``r`` now
        (``consumed``: the tensors its loader read, when a reload just reported them)."""
        if not reads_back(r):
            return
        if consumed is not None:
            want = self._expected(("consumed", folder), lambda: consumed_expected(folder))
            verdict = compare(want, consumed, what="the tensors its loader read", version=folder.name,
                              exhaustive=True)
            if not verdict:
                raise EngineError(f"{r.name}: {verdict.reason}")
        why = self._held_differs(r, folder, expect_identity=folder.name if consumed is not None else None,
                                 first=True)
        if why is not None:
            raise EngineError(f"{r.name}: {why}")

    def _held_differs(self, r: Replica, folder: Path, *, expect_identity: str | None = None,
                      first: bool = False) -> str | None:
        """Why ``r``'s parameters are not ``folder``'s (None when they are), read from ``r`` now. ``first``:
        right after a switch or restart, when the identity it reports is recorded, not compared."""
        if not reads_back(r) or not r.readback:  # nothing comparable: an engine's own label covers identity
            return None
        first = first or not r.held_checked  # never read back whole yet: what it holds now is recorded
        report = r.client.read_held(r.readback)
        if first:
            if expect_identity is not None and report.identity != expect_identity:
                return (f"it reports its last reload as {report.identity!r}, not {expect_identity!r}: the "
                        "reload did not finish")
            r.held_identity = report.identity
        elif report.identity != r.held_identity:
            return (f"it reports its last reload as {report.identity!r}, not {r.held_identity!r}: it was "
                    "restarted or reloaded by someone else")
        want = self._expected(("held", folder, report.dtype),
                              lambda: held_expected(folder, r.readback, report.dtype))
        verdict = compare(want, report.tensors, what=f"its parameters ({report.dtype})", version=folder.name)
        if first:
            r.held_checked = bool(verdict)
        return None if verdict else verdict.reason
