"""Checks before an engine loads a LoRA adapter published alone (``lora_publish: adapter``).

An adapter version arrives as a packed folder rebuilt from the chain (``lora.packed``). Before
any engine sees it: it must be unpacked into peft's layout and validated, its rank must fit the
engine's LoRA slots (``--max-lora-rank``), and the base it was trained on must be the weights
the engine holds (by the fingerprint in ``posttrain_lora_base``). Each refusal names what is
wrong and how to fix it; nothing is loaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from posttrain.lora.adapter import Adapter, BaseRef, LoraError, base_fingerprint
from posttrain.lora.packed import unpack_adapter
from posttrain.serve.checks import same_weights

PEFT_DIR = "peft"  # the unpacked adapter, inside the rebuilt folder (removed with it)


class EngineAdapterError(ValueError):
    """An adapter an engine must not load; the message names the field or file and what is wrong."""


def refuse_adapters(kind: str, folder: Path) -> EngineAdapterError:
    return EngineAdapterError(
        f"{folder.name} is a LoRA adapter published alone (lora_publish: adapter), but this {kind} deployment does "
        "not load adapters at run time: serve with --engine vllm --engine-max-lora-rank N, or publish merged "
        "(lora_publish: merged)")


def unpacked(folder: Path, identity: str, max_rank: int) -> tuple[Adapter, BaseRef]:
    """The adapter of the packed ``folder`` in peft's layout at ``folder/peft``, checked against ``max_rank``."""
    out = folder / PEFT_DIR
    if out.exists():  # unpacked before a gateway restart resumed it
        shutil.rmtree(out)
    try:
        adapter, base = unpack_adapter(folder, out)
    except LoraError as e:
        raise EngineAdapterError(f"adapter {identity}: {e}") from None
    rank = adapter.config["r"]
    if rank > max_rank:
        shutil.rmtree(out, ignore_errors=True)
        raise EngineAdapterError(f"adapter {identity}: r={rank} (its adapter_config.json) is over the engine's "
                                 f"max LoRA rank {max_rank} (--engine-max-lora-rank): raise it or train a smaller r")
    return adapter, base


class BaseCheck:
    """Whether an adapter's base is the model an engine holds; fingerprints cached per folder."""

    def __init__(self, boot_dir: Path) -> None:
        self.boot_dir = boot_dir
        self._fingerprints: dict[Path, str] = {}
        self._same_as_boot: dict[Path, bool] = {}

    def fingerprint(self, folder: Path) -> str:
        if folder not in self._fingerprints:
            self._fingerprints[folder] = base_fingerprint(folder)
        return self._fingerprints[folder]

    def check(self, base: BaseRef, held: Path, identity: str) -> None:
        """Raise unless ``base`` (the adapter's) is ``held`` (the folder the engine loaded), by
        fingerprint, or is the boot folder and ``held`` holds the boot weights (a republished base)."""
        if base.fingerprint == self.fingerprint(held):
            return
        if base.fingerprint == self.fingerprint(self.boot_dir):
            if held not in self._same_as_boot:
                self._same_as_boot[held] = same_weights(held, self.boot_dir)
            if self._same_as_boot[held]:
                return
        raise EngineAdapterError(
            f"adapter {identity} was trained on base {base.path} (fingerprint {base.fingerprint[:12]}), but the "
            f"engine holds {held} (fingerprint {self.fingerprint(held)[:12]}): serve the adapter's base, or publish "
            "merged (lora_publish: merged)")
