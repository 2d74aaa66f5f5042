"""Which weights an SGLang server holds, read back through ``/get_weights_by_name`` and hashed by the gateway.

SGLang has no digest of its own to report (``weight_digest`` explains why answers compared within a
tolerance are not enough), but ``GET|POST /get_weights_by_name {"name", "truncate_size"}`` answers a
parameter's values (sgl-project/sglang ``entrypoints/http_server.py``, ``managers/io_struct.py``
``GetWeightsByNameReqInput``, ``ModelRunner.get_weights_by_name``, ``models/llama.py``):

- the parameter as the model holds it, cast to float32, as nested JSON lists, cut to its first
  ``truncate_size`` rows (default 100: so ``FULL`` here); ``orjson`` writes NaN and infinities as ``null``;
- ``lm_head.weight`` of a tied model is the embeddings; the embeddings and an untied LM head have the
  vocabulary padded to a multiple of 64 (zero rows); ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/
  ``up_proj`` are slices of a fused parameter cut with ``hidden_size // num_attention_heads`` as the head
  size (wrong for a model with another ``head_dim``), so they are never read here;
- 400 ``{"error": {"message": "Get parameter by name failed"}}`` for a name the model does not hold, and
  for every name of a model class without the method: ``LlamaForCausalLM`` (Mistral, Phi3, ...) has it,
  ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` do not (model_runner.py: "TODO: Add support for Qwen
  models"): such a server reads back nothing, and the gateway says so;
- with data parallelism, a list with one value per rank; with tensor parallelism, rank 0's shard of a
  split parameter (embeddings: fewer rows than the checkpoint's, so never comparable).

Float32 holds every bfloat16 and float16 value exactly, so the values cast back to the dtype SGLang holds
are its bytes, hashed with ``weight_digest.describe``; a value that does not survive that cast says the
dtype is wrong, and is refused, never rounded. That dtype is ``--dtype`` from ``/get_server_info``, or
for ``auto`` SGLang's own rule (``configs/model_config.py`` ``_get_and_verify_dtype``) applied to the
model's ``config.json``.

Cost: the whole tensor crosses as JSON text (about 12 bytes a value), and SGLang builds a Python list of
every value of the parameter (``.tolist()`` before cutting to ``truncate_size``: about 32 bytes a value in
its scheduler, which serves nothing meanwhile), whatever ``truncate_size`` asks. So only norms (one row
each), the embeddings and the LM head are read, one request each, and a tensor over
``readback_max_elements`` values (default 4M: about 50 MB of JSON) is not read at all: the embeddings of a
real model (0.5B Qwen: 136M values) are left to the digests of a reload's tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from posttrain.chain.checkpoint import Checkpoint
from posttrain.serve.engine import EngineCallError
from posttrain.serve.http_client import error_message
from posttrain.serve.weight_digest import EMBEDDINGS, TIED_HEAD, HeldReport, HeldTensor, describe

FULL = (1 << 31) - 1  # a truncate_size that keeps every row
READBACK_MAX_ELEMENTS = 1 << 22
NOT_READ = "Get parameter by name failed"
SGLANG_DTYPES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
                 "bfloat16": "bfloat16"}  # model_config.py _STR_DTYPE_TO_TORCH_DTYPE


def sglang_auto_dtype(config: Mapping[str, Any]) -> str:
    """The dtype SGLang holds a model in with ``--dtype auto``: the config's (``dtype``, or ``torch_dtype``),
    float32 (also when absent or unknown) becoming float16, bfloat16 for Gemma (``_get_and_verify_dtype``)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    declared = text.get("dtype") or text.get("torch_dtype")
    dtype = SGLANG_DTYPES.get(declared, "float32") if isinstance(declared, str) else "float32"
    if dtype == "float32":
        return "bfloat16" if str(text.get("model_type", "")).startswith("gemma") else "float16"
    return dtype


def readable(name: str) -> bool:
    """Whether the readback asks SGLang for ``name``: a norm, the embeddings, the LM head (module doc)."""
    return name in (EMBEDDINGS, TIED_HEAD) or name.endswith("norm.weight")


class SGLangReadback:
    """``read_layout``/``read_held`` for ``SGLangClient`` (``url``, ``model_dir``, ``readback_max_elements``,
    and the JSON requests of ``HTTPEngineClient``)."""

    url: str
    model_dir: Path | None
    readback_max_elements: int

    def server_info(self) -> dict[str, Any]:
        """``GET /get_server_info``: SGLang's server args (``dtype``, ``dp_size``, ``model_path``, ...)."""
        info = self._json("GET", "/get_server_info")  # type: ignore[attr-defined]
        if not isinstance(info, dict):
            raise EngineCallError(200, f"GET /get_server_info: not an object: {info!r}"[:300])
        return info

    def engine_dtype(self, info: Mapping[str, Any] | None = None) -> str:
        """The dtype SGLang holds the weights in: its ``--dtype``, or for ``auto`` SGLang's rule on the config
        of ``model_dir`` (else of the ``model_path`` it reports, when that folder is readable here)."""
        info = self.server_info() if info is None else info
        declared = str(info.get("dtype") or "auto").lower()
        if declared != "auto":
            if declared not in SGLANG_DTYPES:
                raise EngineCallError(200, f"GET /get_server_info: dtype {declared!r} is none SGLang computes in")
            return SGLANG_DTYPES[declared]
        places = [p for p in (self.model_dir, info.get("model_path")) if p]
        for folder in places:
            try:
                return sglang_auto_dtype(json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
        raise EngineCallError(200, f"{self.url} runs with --dtype auto and no config.json is readable here "
                                   f"(looked in {[str(p) for p in places]}): its dtype is unknown")

    def weights_by_name(self, name: str, truncate_size: int = FULL) -> Any:
        """``POST /get_weights_by_name``: SGLang's values for ``name`` (NaN where it wrote null), or None when
        it cannot read that name (the module doc says when)."""
        response = self._request("POST", "/get_weights_by_name",  # type: ignore[attr-defined]
                                 json={"name": name, "truncate_size": truncate_size})
        if response.status_code != 200:
            message = error_message(response)
            self._drop_connections()  # type: ignore[attr-defined]
            if response.status_code == 400 and message == NOT_READ:
                return None
            raise EngineCallError(response.status_code, f"POST /get_weights_by_name {name!r}: {message}")
        try:  # an answer is numbers and nulls only: null (NaN, infinity) is read as NaN
            return json.loads(response.text.replace("null", "NaN"))
        except ValueError as e:
            raise EngineCallError(200, f"POST /get_weights_by_name {name!r}: not JSON ({e})") from None

    def read_layout(self, candidates: list[str]) -> dict[str, HeldTensor]:
        """Which of ``candidates`` SGLang holds, with the dtype and shape it holds them in (digest ""): the
        ``readable`` ones it answers for, up to ``readback_max_elements`` values each. Reads them whole:
        SGLang answers no shape without the values."""
        info = self.server_info()
        dtype, ranks = self.engine_dtype(info), int(info.get("dp_size") or 1)
        sizes = self._checkpoint_sizes()
        out: dict[str, HeldTensor] = {}
        for name in candidates:
            size = sizes.get(EMBEDDINGS if name == TIED_HEAD and name not in sizes else name)
            if not readable(name) or (size is None and not name.endswith("norm.weight")):
                continue  # never ask for a tensor of unknown size but the norms' (one row)
            if size is not None and size > self.readback_max_elements:
                continue
            held = self._held_tensor(name, None, dtype, ranks)
            if held is not None:
                out[name] = HeldTensor(held.dtype, held.shape, "", held.finite)
        return out

    def read_held(self, names: Mapping[str, int | None]) -> HeldReport:
        """Digests of ``names`` as SGLang holds them now (an int: only the first that many rows), hashed here
        from the values it answers; ``identity``: the weight version it reports (the gateway names each reload
        after its folder; a restarted SGLang reports its launch version). A name SGLang no longer answers for
        is left out (``compare`` names it missing)."""
        info = self.server_info()
        before, dtype, ranks = self._version(), self.engine_dtype(info), int(info.get("dp_size") or 1)
        tensors = {}
        for name, rows in names.items():
            held = self._held_tensor(name, rows, dtype, ranks)
            if held is not None:
                tensors[name] = held
        after = self._version()
        if after != before:
            raise EngineCallError(409, f"{self.url}: its weight version went from {before!r} to {after!r} while "
                                       "its parameters were read")
        return HeldReport(tensors, before, dtype)

    def _version(self) -> str | None:
        version = self._json("GET", "/get_model_info").get("weight_version")  # type: ignore[attr-defined]
        return None if version is None else str(version)

    def _checkpoint_sizes(self) -> dict[str, int]:
        """Values in each tensor of ``model_dir`` ({} without one)."""
        if self.model_dir is None:
            return {}
        return {n: int(torch.Size(i.shape).numel()) for n, i in Checkpoint.open(self.model_dir).tensors.items()}

    def _held_tensor(self, name: str, rows: int | None, dtype: str, ranks: int) -> HeldTensor | None:
        values = self.weights_by_name(name, FULL if rows is None else rows)
        if values is None:
            return None
        per_rank = [as_held(name, v, dtype) for v in (values if ranks > 1 else [values])]
        first = per_rank[0]
        if any(t.digest != first.digest for t in per_rank):  # data-parallel ranks that disagree: never a match
            return HeldTensor(first.dtype, first.shape, f"ranks differ: {[t.digest for t in per_rank]}",
                              all(t.finite for t in per_rank))
        return first


def as_held(name: str, values: Any, dtype: str) -> HeldTensor:
    """``values`` (SGLang's float32 answer for ``name``) as the ``dtype`` tensor SGLang holds, described.
    EngineCallError when a value is not a ``dtype`` value: SGLang holds another dtype, and rounding would
    hide a difference."""
    wide = torch.tensor(values, dtype=torch.float32)
    held = wide.to(getattr(torch, dtype))
    back = held.to(torch.float32)
    nan = torch.isnan(wide)
    if not (torch.equal(nan, torch.isnan(back)) and torch.equal(wide[~nan], back[~nan])):
        raise EngineCallError(200, f"POST /get_weights_by_name {name!r}: its values are not all {dtype} values: "
                                   f"SGLang holds it in another dtype than the {dtype} expected")
    dtype_name, shape, digest, finite = describe(held)
    return HeldTensor(dtype_name, tuple(shape), digest, finite)
