"""The parameters behind ``FakeSGLang``'s ``/get_weights_by_name``: what its model holds now, read as SGLang does.

SGLang answers ``POST|GET /get_weights_by_name {"name", "truncate_size": 100}`` with
``ModelRunner.get_weights_by_name`` -> ``model.get_weights_by_name(name, truncate_size, tp_size)`` (sgl-project/
sglang ``python/sglang/srt/model_executor/model_runner.py``, ``models/llama.py``; ``managers/io_struct.py``
``GetWeightsByNameReqInput``). Only some model classes have that method: ``LlamaForCausalLM`` (and the
classes built on it: Mistral, Phi3, InternLM3) do, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` do not
(model_runner.py: "TODO: Add support for Qwen models"), so for those every name fails. LlamaForCausalLM's
method, at tensor parallel size 1:

- ``lm_head.weight`` of a model that ties it: the input embeddings;
- a name holding ``.q_proj``/``.k_proj``/``.v_proj``/``.gate_proj``/``.up_proj``: that slice of the fused
  ``qkv_proj``/``gate_up_proj`` parameter, which is the checkpoint's tensor; a fused name: the whole fused one;
- any other parameter name: the parameter, the embeddings and an untied LM head padded with zero rows to a
  multiple of 64 (``VocabParallelEmbedding``); a name the model does not hold raises, caught: ``None``;
- the value: ``weight.cpu().to(torch.float32).numpy().tolist()[:truncate_size]``: the first ``truncate_size``
  rows (elements of a 1-D tensor), as floats; ``ORJSONResponse`` writes NaN and infinities as ``null``.

``None`` becomes HTTP 400 ``{"error": {"message": "Get parameter by name failed"}}`` (http_server.py).

The dtype the model holds is SGLang's ``_get_and_verify_dtype`` (``configs/model_config.py``): ``--dtype``,
or with ``auto`` the config's ``dtype``/``torch_dtype``, float32 (also when absent) becoming float16
(bfloat16 for Gemma).

Test injections (``HeldWeights``): ``drop_on_next_reload(name)`` (the next reload leaves that tensor as it
was), ``serve_cached_on_next_reload()`` (the next reload keeps every old value while SGLang reports the new
folder and version), ``hold(folder)`` (the weights of another folder, as if something reloaded it behind the
gateway's back; the reported version and path stay), ``poison(name)`` (NaN in that tensor). They change what
``/get_weights_by_name`` reads, not the fake's generated tokens, so a test shows what the digests catch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.testing.fake_sglang_model import validation_error

READABLE = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM"})
STACKED = ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj"))  # LlamaForCausalLM's order
FUSED = {".qkv_proj": (".q_proj", ".k_proj", ".v_proj"), ".gate_up_proj": (".gate_proj", ".up_proj")}
VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE
EMBEDDINGS, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
NOT_READ = "Get parameter by name failed"
STR_DTYPES = {"half": torch.float16, "float16": torch.float16, "float": torch.float32, "float32": torch.float32,
              "bfloat16": torch.bfloat16}


def read_config(folder: Path) -> dict:
    """``config.json`` of ``folder`` ({} when there is none)."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def sglang_dtype(server_dtype: str, config: dict) -> torch.dtype:
    """The dtype SGLang's model holds, from ``--dtype`` and the model's config (``_get_and_verify_dtype``)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    declared = text.get("dtype") or text.get("torch_dtype")
    config_dtype = STR_DTYPES.get(declared) if isinstance(declared, str) else None
    config_dtype = config_dtype or torch.float32
    if server_dtype.lower() != "auto":
        return STR_DTYPES[server_dtype.lower()]
    if config_dtype == torch.float32:
        return torch.bfloat16 if str(text.get("model_type", "")).startswith("gemma") else torch.float16
    return config_dtype


def _load(folder: Path, name: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


def to_wire(t: torch.Tensor, truncate_size: int) -> list:
    """SGLang's answer for ``t``: float32 values as nested lists, NaN/inf as None, first ``truncate_size`` rows."""
    wide = t.detach().to(torch.float32).numpy()
    if np.isfinite(wide).all():
        return wide.tolist()[:truncate_size]
    boxed = wide.astype(object)
    boxed[~np.isfinite(wide)] = None
    return boxed.tolist()[:truncate_size]


class HeldWeights:
    """The fake model's parameters: the tensors of ``folder`` in the engine's dtype, except those in ``kept``
    (held from before, or injected). Config and dtype are the boot folder's, as SGLang fixes them at launch."""

    def __init__(self, folder: Path, server_dtype: str) -> None:
        config = read_config(folder)
        self.dtype = sglang_dtype(server_dtype, config)
        self.architecture = (config.get("architectures") or [None])[0]
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.folder = folder
        self.kept: dict[str, torch.Tensor] = {}
        self._drop: set[str] = set()
        self._cached = False

    # -- test injections ------------------------------------------------------------------
    def drop_on_next_reload(self, name: str) -> None:
        self._drop.add(name)

    def serve_cached_on_next_reload(self) -> None:
        self._cached = True

    def hold(self, folder: Path) -> None:
        self.folder, self.kept = Path(folder), {}

    def poison(self, name: str) -> None:
        t = self.tensor(name)
        if t is None:
            raise ValueError(f"FakeSGLang holds no tensor {name!r} to poison")
        t = t.clone()
        t.view(-1)[0] = float("nan")
        self.kept[name] = t

    # -- SGLang's behaviour ---------------------------------------------------------------
    def reload(self, folder: Path) -> None:
        """After a successful ``/update_weights_from_disk`` of ``folder``, with the injections armed."""
        keep = self.names() if self._cached else self._drop
        kept = {n: t for n in keep if (t := self.tensor(n)) is not None}  # read before the folder changes
        self.folder, self.kept = Path(folder), kept
        self._drop, self._cached = set(), False

    def names(self) -> list[str]:
        from safetensors import safe_open

        out: list[str] = []
        for file in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                out.extend(f.keys())
        return out + [n for n in self.kept if n not in out]

    def tensor(self, name: str) -> torch.Tensor | None:
        """Checkpoint tensor ``name`` as the model holds it (engine dtype, unpadded), or None."""
        if name in self.kept:
            return self.kept[name]
        t = _load(self.folder, name)
        return None if t is None else t.to(self.dtype)

    def parameter(self, name: str) -> torch.Tensor | None:
        """What ``LlamaForCausalLM.get_weights_by_name`` reads for ``name`` at tp 1 (None: it fails)."""
        if self.architecture not in READABLE:
            return None
        if name == LM_HEAD and self.tied:
            return self._padded(EMBEDDINGS)
        for fused, shard in STACKED:
            if shard in name:  # the slice of the fused parameter: the checkpoint's tensor
                return self.tensor(name)
        for fused, shards in FUSED.items():
            if fused in name:
                parts = [self.tensor(name.replace(fused, s)) for s in shards]
                return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]
        return self._padded(name) if name in (EMBEDDINGS, LM_HEAD) else self.tensor(name)

    def _padded(self, name: str) -> torch.Tensor | None:
        t = self.tensor(name)
        if t is None:
            return None
        rows = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])

    def route(self, body: dict[str, Any]) -> tuple[int, Any]:
        """``/get_weights_by_name``'s status and body for a request ``body`` (``GetWeightsByNameReqInput``)."""
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            return validation_error("name: Field required")
        if not isinstance(size, int) or isinstance(size, bool):
            return validation_error("truncate_size: Input should be a valid integer")
        t = self.parameter(name)
        if t is None:  # http_server.py: _create_error_response("Get parameter by name failed")
            return 400, {"error": {"message": NOT_READ}}
        return 200, to_wire(t, size)


def write_tiny_llama(folder: Path, *, seed: int = 0, dtype: str = "float32", tie: bool = True,
                     vocab_size: int = 100) -> Path:
    """A tiny ``LlamaForCausalLM`` folder (``config.json``, ``model.safetensors``; no tokenizer): a model whose
    SGLang class answers ``/get_weights_by_name`` (the tiny Qwen2 of ``posttrain.models.tiny`` is not one).
    ``vocab_size`` 100 is padded to 128 rows by SGLang."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at 1.0 everywhere: make each its own
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * 0.1)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return Path(folder)
