"""The two sides a promotion compares, and how each is made to answer: a snapshot of the store,
hot-loaded into a deployment (``load_version``) and evaluated there (``eval_snapshot``, its result
stored and reused), and what production serves when its history names no champion, evaluated on
production itself (``eval_served``: the boot weights a first candidate must beat)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.chain.errors import FormatError
from posttrain.chain.fetch import SnapshotError, SnapshotSource
from posttrain.chain.format import check_identity
from posttrain.inference.contract import HotLoader, HotLoadResult
from posttrain.promote.evaluate import EvalError, EvalResult, EvalSettings, EvalStore, evaluate
from posttrain.rollouts.client import CompletionsClient
from posttrain.storage import Store

BOOT_WEIGHTS = "boot-weights"  # the eval's identity of weights no snapshot names


class PromotionError(ValueError):
    """Bad input to promote or rollback (an unknown identity, no earlier champion): nothing changed."""


@dataclass
class Deployment:
    """A deployment as promotion sees it: its history name, its hot-loader, and (staging) its completions."""

    name: str
    loader: HotLoader
    completions: Callable[[], CompletionsClient] | None = None


def describe_snapshot(store: Store, identity: str) -> tuple[str, str | None]:
    """("full", None) or ("delta", base) of a snapshot in the store; ``PromotionError`` naming the
    identity when the store has no such snapshot."""
    try:
        check_identity(identity)
        with tempfile.TemporaryDirectory(prefix="posttrain-describe-") as tmp:
            return SnapshotSource(store, "", Path(tmp)).describe(identity)
    except FormatError as e:
        raise PromotionError(str(e)) from None
    except SnapshotError as e:
        raise PromotionError(f"unknown identity {identity}: {e}") from None


def load_version(loader: HotLoader, store: Store, identity: str) -> HotLoadResult:
    """Make a deployment serve ``identity``, a snapshot of any chain in the store: a delta is named
    with its own base, and the deployment rebuilds it from whatever it holds (docs/hotload-api.md)."""
    kind, base = describe_snapshot(store, identity)
    return loader.hot_load(identity, base_identity=base if kind == "delta" else None)


def eval_snapshot(identity: str, deployment: Deployment, store: Store, rows: list[dict[str, Any]],
               settings: EvalSettings, digest: str, tokenizer, results: EvalStore, *,
               log: Callable[[str], None]) -> EvalResult:
    stored = results.get(digest, identity)
    if stored is not None:
        log(f"{identity}: reusing its stored eval ({digest}): mean reward {stored.mean:.4f}")
        return stored
    load_version(deployment.loader, store, identity)
    assert deployment.completions is not None, "the staging deployment needs completions"
    client = deployment.completions()
    try:
        result = evaluate(rows, settings, client, tokenizer, identity=identity, digest=digest)
    finally:
        client.close()
    log(f"{identity}: mean reward {result.mean:.4f} over {len(result.rewards)} prompts "
        f"x {settings.samples_per_prompt} ({result.seconds:.1f}s)")
    return results.put(result)



def eval_served(production: Deployment, rows: list[dict[str, Any]], settings: EvalSettings, digest: str,
                 tokenizer, *, log: Callable[[str], None]) -> EvalResult:
    """What production serves, evaluated on production itself: a first promotion's champion. Its boot
    weights (no snapshot: never hot-loaded) or a snapshot loaded outside the history; not stored, as
    nothing names the boot weights across restarts."""
    served = sorted(production.loader.served_identities())
    if len(served) > 1:
        raise EvalError(f"deployment {production.name} serves {', '.join(served)} at once (a hot-load under way?)")
    label = served[0] if served else BOOT_WEIGHTS
    assert production.completions is not None, "checked by promote"
    client = production.completions()
    try:
        result = evaluate(rows, settings, client, tokenizer, identity=label, digest=digest,
                          served=served[0] if served else None)
    finally:
        client.close()
    log(f"production serves {label if served else 'its boot weights'}: mean reward {result.mean:.4f} over "
        f"{len(result.rewards)} prompts x {settings.samples_per_prompt} ({result.seconds:.1f}s)")
    return result


def served_name(result: EvalResult | None) -> str:
    """How a decision names what production serves: its boot weights, or the snapshot it was found serving."""
    if result is None or result.identity == BOOT_WEIGHTS:
        return "production's boot weights"
    return f"production's snapshot {result.identity}"
