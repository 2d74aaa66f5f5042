"""A LoRA checkpoint: peft's adapter layout plus a reference to the base it was trained on.

A checkpoint folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (peft's own
files; ``base_model_name_or_path`` names the base's folder) and ``posttrain.lora-base.json``, the
base's path and fingerprint (xxh3-128 of its safetensors files, ``base_fingerprint``). A merge
checks the fingerprint of the base it reads against it, so an adapter is never merged into
another model that happens to have the same tensor names and shapes.

Only plain LoRA on linear layers is accepted (what ``merge`` reproduces bit for bit): no DoRA,
rsLoRA is fine, no LoRA bias, no ``modules_to_save``, no per-module rank or alpha patterns, no
embedding adapters. Everything refused is named in a one-line ``LoraError``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from posttrain.fsutil import atomic_write

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_REF = "posttrain.lora-base.json"
KEY_RE = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
# Config keys whose non-default value changes what a merge computes; refused.
UNSUPPORTED = {"use_dora": False, "lora_bias": False, "modules_to_save": None, "rank_pattern": {},
               "alpha_pattern": {}, "layer_replication": None, "target_parameters": None,
               "trainable_token_indices": None, "use_qalora": False, "alora_invocation_tokens": None,
               "arrow_config": None}
ADAPTER_DTYPES = {"F32", "F16", "BF16"}
_READ = 8 << 20


class LoraError(ValueError):
    """An adapter, a base or their pairing that cannot be merged; one line naming what is wrong."""


@dataclass(frozen=True)
class BaseRef:
    """The base an adapter was trained on: its folder and the fingerprint of its weights."""

    path: str
    fingerprint: str


@dataclass
class Adapter:
    """A validated LoRA adapter folder."""

    path: Path
    config: dict
    scaling: float
    fan_in_fan_out: bool
    # module name in the base (e.g. model.layers.0.self_attn.q_proj) -> (A key, B key) in the adapter file
    modules: dict[str, tuple[str, str]]
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # key -> (dtype, shape)
    base: BaseRef | None = None

    @property
    def base_path(self) -> str:
        return self.base.path if self.base else str(self.config.get("base_model_name_or_path") or "")


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header JSON) of a safetensors file; ``LoraError`` when it is not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise LoraError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > min(size - 8, 100 << 20):
                raise LoraError(f"{path}: safetensors header of {n} bytes does not fit the file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise LoraError(f"{path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoraError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise LoraError(f"{path}: safetensors header is not a JSON object")
    return 8 + n, header


def weight_files(model_dir: Path) -> list[str]:
    """The safetensors files of a model folder, in index order; ``LoraError`` when there are none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise LoraError(f"{index}: not a safetensors index with a weight_map") from None
        return list(dict.fromkeys(weight_map.values()))
    if (model_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise LoraError(f"{model_dir}: no model.safetensors or model.safetensors.index.json (a base must be safetensors)")


def base_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """xxh3-128 over the base's safetensors files (name and bytes of each, in index order)."""
    model_dir = Path(model_dir)
    total = xxhash.xxh3_128()
    for name in weight_files(model_dir):
        h = xxhash.xxh3_128()
        with open(model_dir / name, "rb") as f:
            while chunk := f.read(_READ):
                h.update(chunk)
        total.update(json.dumps([name, h.hexdigest()]).encode())
    return total.hexdigest()


def combine_fingerprint(file_digests: list[tuple[str, str]]) -> str:
    """The fingerprint from (file name, xxh3-128 of its bytes) pairs, in index order."""
    total = xxhash.xxh3_128()
    for name, digest in file_digests:
        total.update(json.dumps([name, digest]).encode())
    return total.hexdigest()


def write_base_ref(checkpoint: str | os.PathLike[str], ref: BaseRef) -> Path:
    return atomic_write(Path(checkpoint) / BASE_REF, json.dumps({"path": ref.path, "fingerprint": ref.fingerprint},
                                                                indent=2) + "\n")


def read_adapter(path: str | os.PathLike[str]) -> Adapter:
    """Read and validate an adapter folder (config, tensor names and shapes; no tensor data)."""
    path = Path(path)
    cfg_path = path / ADAPTER_CONFIG
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise LoraError(f"{path}: no {ADAPTER_CONFIG} (not a peft adapter folder)") from None
    except (OSError, ValueError) as e:
        raise LoraError(f"{cfg_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{cfg_path}: not a JSON object")
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{cfg_path}: peft_type is {config.get('peft_type')!r}; only LORA adapters can be merged")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{cfg_path}: bias={config['bias']!r} is not supported (only 'none')")
    for key, default in UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, False, {}, []):
            raise LoraError(f"{cfg_path}: {key}={config[key]!r} is not supported by the merge")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, int | float):
        raise LoraError(f"{cfg_path}: r={r!r} and lora_alpha={alpha!r} must be a positive integer and a number")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise LoraError(f"{path}: no {ADAPTER_WEIGHTS}")
    _, header = safetensors_header(weights)
    tensors, pairs = {}, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        m = KEY_RE.fullmatch(key)
        if m is None:
            raise LoraError(f"{weights}: tensor {key!r} is not a LoRA A/B matrix of a linear layer")
        dtype, shape = entry.get("dtype"), tuple(entry.get("shape", ()))
        if dtype not in ADAPTER_DTYPES or len(shape) != 2:
            raise LoraError(f"{weights}: tensor {key!r} is {dtype} {list(shape)}; expected a 2-D F32, F16 or BF16 matrix")
        tensors[key] = (dtype, shape)
        pairs.setdefault(m.group(1), {})[m.group(2)] = key
    if not pairs:
        raise LoraError(f"{weights}: holds no LoRA matrices")
    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{weights}: module {module!r} has lora_{''.join(ab)} but not its pair")
        (ra, _), (_, rb) = tensors[ab["A"]][1], tensors[ab["B"]][1]
        if ra != r or rb != r:
            raise LoraError(f"{weights}: module {module!r} has rank {ra}/{rb}, but r={r} in {ADAPTER_CONFIG}")
        modules[module] = (ab["A"], ab["B"])
    base = None
    ref_path = path / BASE_REF
    if ref_path.is_file():
        try:
            ref = json.loads(ref_path.read_text())
            base = BaseRef(path=str(ref["path"]), fingerprint=str(ref["fingerprint"]))
        except (OSError, ValueError, KeyError, TypeError):
            raise LoraError(f"{ref_path}: not a base reference (path, fingerprint)") from None
    return Adapter(path=path, config=config, scaling=float(scaling), fan_in_fan_out=bool(config.get("fan_in_fan_out")),
                   modules=modules, tensors=tensors, base=base)
