"""A LoRA adapter packed as a model-like checkpoint folder, so it travels through the snapshot chain.

The chain carries safetensors tensors and one ``config.json`` (see chain/encode.py). A packed
adapter is a folder with ``model.safetensors`` (the adapter's tensors, linked, names unchanged)
and ``config.json``: peft's ``adapter_config.json`` plus ``posttrain_lora_base``, the base
reference of ``posttrain.lora-base.json``. The publisher encodes it like any checkpoint (full
snapshot first, deltas between adapter versions after), and an engine that rebuilt it from the
chain unpacks it back into peft's layout (``unpack_adapter``) for its runtime LoRA loader.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from posttrain.fsutil import atomic_write, publish_dir, staging_dir
from posttrain.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    Adapter,
    BaseRef,
    LoraError,
    base_fingerprint,
    read_adapter,
    write_base_ref,
)

PACKED_CONFIG = "config.json"
PACKED_WEIGHTS = "model.safetensors"
BASE_KEY = "posttrain_lora_base"  # the base reference inside the packed config.json
INDEX = "model.safetensors.index.json"


def is_packed_adapter(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder``'s config.json is a packed LoRA adapter's (a peft config, not a model's)."""
    try:
        config = json.loads((Path(folder) / PACKED_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "peft_type" in config


def pack_adapter(adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 *, base_dir: str | os.PathLike[str] | None = None,
                 extra_files: tuple[str, ...] = ("trainer_state.json",)) -> Adapter:
    """Write adapter ``adapter_dir`` as a packed folder ``out_dir`` (which must not exist); the
    adapter is validated first (``LoraError``) and must record its base (``posttrain.lora-base.json``),
    which must be ``base_dir``'s weights (by fingerprint) when given."""
    adapter_dir, out = Path(adapter_dir), Path(out_dir)
    adapter = read_adapter(adapter_dir)
    if adapter.base is None:
        raise LoraError(f"adapter {adapter_dir}: no posttrain.lora-base.json (its base's path and fingerprint); "
                        "an adapter published alone must name the base it needs")
    if base_dir is not None and adapter.base.fingerprint != base_fingerprint(base_dir):
        raise LoraError(f"adapter {adapter_dir} was trained on base {adapter.base.path}, not on the run's "
                        f"base_model {base_dir} (fingerprints differ); nothing was published")
    if out.exists():
        raise LoraError(f"{out}: already exists")
    config = {**adapter.config, BASE_KEY: {"path": adapter.base.path, "fingerprint": adapter.base.fingerprint}}
    with staging_dir(out, clear_leftovers=True) as tmp:
        _link(adapter_dir / ADAPTER_WEIGHTS, tmp / PACKED_WEIGHTS)
        atomic_write(tmp / PACKED_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in extra_files:
            if (adapter_dir / name).is_file():
                shutil.copy2(adapter_dir / name, tmp / name)
        publish_dir(tmp, out, sync_files=True)
    return adapter


def unpack_adapter(folder: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> tuple[Adapter, BaseRef]:
    """Write the packed adapter ``folder`` (as rebuilt from the chain) in peft's layout at
    ``out_dir`` (which must not exist); the adapter, validated, and the base it needs."""
    folder, out = Path(folder), Path(out_dir)
    cfg_path = folder / PACKED_CONFIG
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        ref = config.pop(BASE_KEY)
        base = BaseRef(path=str(ref["path"]), fingerprint=str(ref["fingerprint"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise LoraError(f"{cfg_path}: not a packed LoRA adapter config (a peft config with {BASE_KEY})") from None
    with staging_dir(out, clear_leftovers=True) as tmp:
        atomic_write(tmp / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
        shards = _shards(folder)
        if len(shards) == 1:
            _link(folder / shards[0], tmp / ADAPTER_WEIGHTS)
        else:  # an adapter over the shard size limit: peft and vLLM read one file
            _join(folder, shards, tmp / ADAPTER_WEIGHTS)
        write_base_ref(tmp, base)
        adapter = read_adapter(tmp)
        publish_dir(tmp, out)
    adapter.path = out
    return adapter, base


def _shards(folder: Path) -> list[str]:
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
            return sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise LoraError(f"{folder / INDEX}: not a safetensors index with a weight_map") from None
    if (folder / PACKED_WEIGHTS).is_file():
        return [PACKED_WEIGHTS]
    raise LoraError(f"{folder}: no {PACKED_WEIGHTS} and no {INDEX}")


def _join(folder: Path, shards: list[str], dest: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name in shards:
        tensors.update(load_file(str(folder / name)))
    save_file(tensors, str(dest), metadata={"format": "pt"})


def _link(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another file system, or no hard links: a copy
        shutil.copy2(src, dest)
