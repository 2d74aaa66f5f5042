"""Merge a LoRA adapter into its base, tensor by tensor: ``W + scale · B @ A``, streamed.

Each base shard is read in file order with plain reads and written to a merged shard with the
same header (same names, dtypes, shapes and offsets: the merge changes values only), so memory
stays near the largest target matrix whatever the model size, and tensors the adapter does not
touch are copied byte for byte (the chain encodes them as unchanged). safetensors' ``safe_open``
maps whole files; the pages a pass touches would count in the merging process's resident memory,
so the shards are read with ``pread``-style reads instead, 8 MiB at a time.

Bit-exact with peft's ``PeftModel.from_pretrained(base, adapter).merge_and_unload()`` (default
``autocast_adapter_dtype=True``): peft loads F16/BF16 adapter matrices as float32, computes
``transpose(B @ A, fan_in_fan_out) * scaling`` in float32 (``get_delta_weight``) and adds it in
place to the base weight (``weight.data += delta``, i.e. the sum in float32 rounded once to the
weight's dtype). The same torch operations are replayed here on the same tensors, so F32, BF16
and F16 bases are supported exactly; there is no reason to refuse them as Axolotl does (it
refuses non-BF16 bases because its publisher only handles BF16). Any other base dtype of a
target matrix (integer, FP8: a quantized base) is refused, as is a base with a
``quantization_config``: peft would dequantize, which a tensor-level merge cannot reproduce.

Everything that can be checked from headers (each target exists in the base, is 2-D, its shape
fits A and B, its dtype is supported) is checked before a byte is written; the base's fingerprint
is computed while reading and checked against the adapter's ``posttrain.lora-base.json`` before
the merged folder is moved into place. A failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import xxhash

from posttrain.fsutil import publish_dir, staging_dir
from posttrain.lora.adapter import (
    ADAPTER_WEIGHTS,
    Adapter,
    LoraError,
    combine_fingerprint,
    read_adapter,
    safetensors_header,
    weight_files,
)

BASE_DTYPES = {"F32", "BF16", "F16"}
_CHUNK = 8 << 20
# Files of the base folder copied into the merged folder beside the weights.
BASE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt",
              "tokenizer.model", "model.safetensors.index.json")


@dataclass
class MergeResult:
    path: Path
    merged_tensors: int
    total_tensors: int
    base_fingerprint: str


@dataclass
class _Target:
    module: str
    a_key: str
    b_key: str


def _base_layout(base: Path) -> tuple[list[str], dict[str, tuple[str, dict]]]:
    """The base's shard files and, per tensor, (file, header entry)."""
    files = weight_files(base)
    layout: dict[str, tuple[str, dict]] = {}
    for name in files:
        if not (base / name).is_file():
            raise LoraError(f"{base}: shard {name} named by the index is missing")
        _, header = safetensors_header(base / name)
        for key, entry in header.items():
            if key != "__metadata__":
                layout[key] = (name, entry)
    return files, layout


def check_pairing(adapter: Adapter, base: Path, layout: dict[str, tuple[str, dict]]) -> dict[str, _Target]:
    """Base tensor name -> target, after checking every target against the base's headers."""
    cfg = base / "config.json"
    if cfg.is_file():
        try:
            quant = json.loads(cfg.read_text()).get("quantization_config")
        except (OSError, ValueError, AttributeError):
            quant = None
        if quant:
            raise LoraError(f"{cfg}: a quantized base (quantization_config) cannot be merged exactly; "
                            "merge into the unquantized base")
    targets = {}
    for module, (a_key, b_key) in adapter.modules.items():
        name = f"{module}.weight"
        if name not in layout:
            raise LoraError(f"adapter {adapter.path}: target module {module!r} has no tensor {name!r} in base {base}")
        dtype, shape = layout[name][1].get("dtype"), tuple(layout[name][1].get("shape", ()))
        if dtype not in BASE_DTYPES:
            raise LoraError(f"base {base}: tensor {name!r} is {dtype}; only F32, BF16 and F16 bases can be merged "
                            "bit-exactly with peft")
        (r, fan_in), (fan_out, _) = adapter.tensors[a_key][1], adapter.tensors[b_key][1]
        expected = (fan_in, fan_out) if adapter.fan_in_fan_out else (fan_out, fan_in)
        if shape != expected:
            raise LoraError(f"adapter {adapter.path}: module {module!r} is lora_B {[fan_out, r]} @ lora_A {[r, fan_in]} "
                            f"= {list(expected)}, but base {base} has {name!r} of shape {list(shape)}")
        targets[name] = _Target(module, a_key, b_key)
    return targets


def check_base(adapter: Adapter, base: Path) -> None:
    """The base named by the adapter and the base given must be the same model folder (by path when
    the adapter has no fingerprint; the fingerprint is checked while merging)."""
    if adapter.base is None and adapter.base_path and os.path.realpath(adapter.base_path) != os.path.realpath(base):
        raise LoraError(f"adapter {adapter.path} was trained on {adapter.base_path}, not on {base} "
                        "(and records no base fingerprint to prove they are the same)")


def merge_adapter(adapter_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str],
                  out_dir: str | os.PathLike[str], *, extra_files: tuple[str, ...] = ("trainer_state.json",)
                  ) -> MergeResult:
    """Write ``base + adapter`` as a model folder ``out_dir`` (which must not exist).

    ``extra_files``: files of the adapter folder copied too (``trainer_state.json`` keeps its step).
    """
    import torch

    adapter_dir, base, out = Path(adapter_dir), Path(base_dir), Path(out_dir)
    adapter = read_adapter(adapter_dir)
    files, layout = _base_layout(base)
    targets = check_pairing(adapter, base, layout)
    check_base(adapter, base)
    if out.exists():
        raise LoraError(f"{out}: already exists")
    lora = _load_lora(adapter)
    digests = []
    with staging_dir(out, clear_leftovers=True) as tmp:
        for name in files:
            digests.append((name, _merge_shard(base / name, tmp / name, targets, lora, adapter, torch)))
        fingerprint = combine_fingerprint(digests)
        if adapter.base is not None and fingerprint != adapter.base.fingerprint:
            raise LoraError(f"adapter {adapter.path} was trained on base {adapter.base.path} (fingerprint "
                            f"{adapter.base.fingerprint[:12]}), but {base} has fingerprint {fingerprint[:12]}")
        for fname in BASE_FILES:
            if (base / fname).is_file():
                shutil.copy2(base / fname, tmp / fname)
        for fname in extra_files:
            if (adapter_dir / fname).is_file():
                shutil.copy2(adapter_dir / fname, tmp / fname)
        publish_dir(tmp, out, sync_files=True)
    return MergeResult(out, len(targets), len(layout), fingerprint)


def _load_lora(adapter: Adapter) -> dict:
    """The adapter's matrices as peft holds them after loading: F16/BF16 upcast to float32."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(adapter.path / ADAPTER_WEIGHTS))
    return {k: (v.float() if v.dtype in (torch.float16, torch.bfloat16) else v) for k, v in tensors.items()}


def _merge_shard(src: Path, dst: Path, targets: dict[str, _Target], lora: dict, adapter: Adapter, torch) -> str:
    """Copy ``src`` to ``dst`` merging the target tensors; returns the xxh3-128 of ``src``'s bytes."""
    start, header = safetensors_header(src)
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"][0])
    h = xxhash.xxh3_128()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        head = fin.read(start)
        h.update(head)
        fout.write(head)
        pos = start
        for key, entry in entries:
            begin, end = (start + o for o in entry["data_offsets"])
            if begin != pos:  # padding or a gap: copied as it is
                _copy(fin, fout, h, begin - pos)
            if key in targets:
                raw = bytearray(fin.read(end - begin))
                if len(raw) != end - begin:
                    raise LoraError(f"{src}: truncated in tensor {key!r}")
                h.update(raw)
                fout.write(_merged(raw, entry, targets[key], lora, adapter, torch))
            else:
                _copy(fin, fout, h, end - begin)
            pos = end
        while chunk := fin.read(_CHUNK):  # trailing bytes, if any
            h.update(chunk)
            fout.write(chunk)
    return h.hexdigest()


def _copy(fin, fout, h, n: int) -> None:
    while n > 0:
        chunk = fin.read(min(n, _CHUNK))
        if not chunk:
            raise LoraError(f"{fin.name}: truncated")
        h.update(chunk)
        fout.write(chunk)
        n -= len(chunk)


_TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _merged(raw: bytearray, entry: dict, target: _Target, lora: dict, adapter: Adapter, torch) -> bytes:
    """peft's LoraLayer.merge (safe_merge=False) on one weight: ``weight.data += get_delta_weight()``."""
    dtype = getattr(torch, _TORCH_DTYPES[entry["dtype"]])
    weight = torch.frombuffer(raw, dtype=dtype).reshape(entry["shape"])
    lora_a, lora_b = lora[target.a_key], lora[target.b_key]
    delta = lora_b @ lora_a
    if adapter.fan_in_fan_out:
        delta = delta.T
    delta = delta * adapter.scaling
    weight += delta  # no NaN check: peft's default merge (safe_merge=False) makes none, and it costs 25% here
    return raw  # ``weight`` is a view of ``raw``: the in-place sum is already there
