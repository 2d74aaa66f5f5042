"""The seam between the hot-load gateway and what actually serves: an ``Engine``.

The gateway (``server``: HTTP, auth, the v1alpha1 hot-load API, ``hotload_service``: fetching
and rebuilding versions) is the same whatever serves; an engine only answers completions and
switches to a folder it is given. ``reference.ReferenceEngine`` serves with transformers in
this process; ``vllm.engine.VLLMEngine`` drives vLLM servers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from posttrain.errors import TransientError


@dataclass(frozen=True)
class Served:
    """What an engine serves: the snapshot identity (None for boot weights that record none) and
    the folder holding those weights (the held version a delta is rebuilt from). For a LoRA adapter
    published alone, ``path`` is the adapter's folder and ``base`` the model folder it is served on."""

    identity: str | None
    path: Path
    base: Path | None = None


class EngineError(Exception):
    """An engine could not do what it was asked; the message says which replica and why."""


class EngineCallError(EngineError):
    """A server of an engine answered a request with a non-200 ``status`` and an error ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the engine answered {status}: {message}")
        self.status = status
        self.message = message


class EngineUnavailable(EngineCallError, TransientError):
    """A server of an engine did not answer at all (refused, reset or timed out); ``status`` is 0."""

    def __init__(self, message: str) -> None:
        EngineCallError.__init__(self, 0, message)
        self.args = (f"the engine did not answer: {message}",)


class Engine(Protocol):
    model_name: str
    max_positions: int | None
    replica_names: list[str]

    def current(self) -> Served:
        """The version served now."""
        ...

    def load(self, folder: Path, identity: str) -> Served:
        """Serve the weights in ``folder`` as ``identity`` from the next request on. On failure
        raise (``EngineError`` or ``ValueError`` naming the tensor or file) with the previous
        version still served, or with the broken replicas reported by ``replica_errors``."""
        ...

    def resume(self, folder: Path, identity: str) -> Served:
        """At start, serve again the version a restarted server recorded (``folder``, checked against its
        checksums already). Replicas that hold it already are adopted as they are, never reloaded with
        the boot weights first."""
        ...

    def verify(self) -> None:
        """Read back from every replica that it holds the version served; put back those that do not, and
        raise ``EngineError`` naming the ones that cannot serve it."""
        ...

    def complete(self, body: object) -> dict:
        """Answer an OpenAI-style ``/v1/completions`` body with token ids and logprobs, stamped
        with ``snapshot_identity``, the version that sampled it. Raises ``RequestError``."""
        ...

    def replica_errors(self) -> dict[str, str]:
        """Replicas that cannot serve right now, with the reason (empty when all can)."""
        ...

    def close(self) -> None:
        ...


class EngineClient(Protocol):
    """One server of an engine in another process (vLLM, SGLang), over HTTP."""

    def health(self) -> bool: ...

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI-style completions body in, the OpenAI-style answer (token ids, logprobs) out."""
        ...

    def pause(self) -> None:
        """Finish the requests in flight, take no new ones."""
        ...

    def reload(self, folder: Path) -> None:
        """Load the weights in ``folder`` (between ``pause`` and ``resume``)."""
        ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


class EngineProcess(Protocol):
    """A server of an engine that the gateway started and supervises."""

    def alive(self) -> bool: ...

    def restart(self, model_dir: Path | None = None) -> None:
        """Stop it and start it again on ``model_dir``; returns once it serves."""
        ...

    def stop(self) -> None: ...

    def close(self) -> None:
        """Stop it for good: a restart racing this (the gateway's monitor) leaves nothing running."""
        ...
