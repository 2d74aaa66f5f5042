"""Read back, inside a vLLM worker, exactly which weights it holds: a vLLM worker extension.

vLLM mixes this class into its worker class when started with
``--worker-extension-cls posttrain_readback.WeightReadback`` (the gateway's ``VLLMProcess`` does,
with this file on vLLM's ``PYTHONPATH`` as ``posttrain_readback``); its methods are then called through
the dev-mode ``POST /collective_rpc`` route the in-place reload already uses. So this module runs in
vLLM's own venv: it imports torch and xxhash only, never ``posttrain`` (``posttrain.serve.weight_digest``
imports :func:`describe` from here, so both sides hash the same way).

- ``posttrain_reload(weights_path, identity)``: reload the folder in place, hashing every tensor the
  loader hands to the model as it goes by, and return those digests: a reload that re-serves cached
  weights or skips a tensor shows as digests that differ from, or miss, the snapshot's.
- ``posttrain_held(names)``: digests of the named parameters as they sit in memory now (in the engine's
  dtype), with the identity of the last reload through ``posttrain_reload`` (None after a restart).

A digest is the xxh3-128 of the tensor's bytes as held (contiguous, little-endian): for a tensor read
from a safetensors file, the same digest as ``posttrain.checksums.json`` records for it.
"""

from __future__ import annotations

import json

import torch
import xxhash

VERSION = 1  # what posttrain_version answers: the gateway refuses an extension it does not speak


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def digest(t: torch.Tensor) -> str:
    """xxh3-128 (hex) of ``t``'s bytes as held: contiguous, little-endian, on the CPU."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return xxhash.xxh3_128_hexdigest(flat.view(torch.uint8).numpy())


def describe(t: torch.Tensor) -> list:
    """``[dtype, shape, digest, finite]``: one tensor as the wire carries it (JSON-safe)."""
    # a sum is finite when every value is (accumulated in float32 at least: no overflow on real weights),
    # and costs a tenth of isfinite().all() on CPU; only a non-finite sum is looked at value by value
    finite = not t.is_floating_point() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
    return [dtype_name(t.dtype), list(t.shape), digest(t), finite]


class WeightReadback:
    """Methods vLLM adds to its worker (``self`` is the worker: ``self.model_runner``, ``self.vllm_config``)."""

    def posttrain_version(self) -> dict:
        return {"version": VERSION, "dtype": dtype_name(self.vllm_config.model_config.dtype)}

    def _posttrain_source(self, weights_path: str):
        """The (name, tensor) pairs vLLM's loader reads from ``weights_path``, as ``reload_weights`` reads
        them (a test subclass overrides this to drop a tensor or re-serve cached ones)."""
        from vllm.model_executor.model_loader import get_model_loader

        model_config = self.vllm_config.model_config
        # as vllm.model_executor.model_loader.reload.inplace does for a path: the revision and any
        # object-storage source belong to the weights reloaded away from
        model_config.model, model_config.model_weights, model_config.revision = weights_path, "", None
        loader = get_model_loader(self.vllm_config.load_config)
        return loader.get_all_weights(model_config, self.model_runner.get_model())

    def posttrain_reload(self, weights_path: str, identity: str) -> dict:
        """Reload ``weights_path`` in place; the digest of every tensor the loader handed to the model."""
        consumed: dict[str, list] = {}

        def tapped():
            for name, tensor in self._posttrain_source(weights_path):
                # a name read twice keeps its last digest, and says so: the model took both
                consumed[name] = describe(tensor) if name not in consumed else ["duplicate", [], "", False]
                yield name, tensor

        self._posttrain_identity = None  # until the reload finished: a failed one holds no known version
        self.reload_weights(weights_iterator=tapped(), is_checkpoint_format=True)
        self._posttrain_identity = identity
        return {"consumed": consumed, "dtype": dtype_name(self.vllm_config.model_config.dtype)}

    def posttrain_held(self, names: str) -> dict:
        """Digests of the parameters named in ``names`` (a JSON object name -> rows: the first ``rows``
        rows only, for a vocabulary padded past the checkpoint's; null: all of it; ``{}``: every parameter
        with no digest, to learn the layout) as they sit in memory, and the identity of the last
        ``posttrain_reload`` (None after a restart)."""
        wanted = json.loads(names)
        params = dict(self.model_runner.get_model().named_parameters())
        if wanted:
            tensors = {n: describe(params[n].data if rows is None else params[n].data[:rows])
                       for n, rows in wanted.items() if n in params}
        else:
            tensors = {n: [dtype_name(p.dtype), list(p.shape), "", True] for n, p in params.items()}
        return {"tensors": tensors, "identity": getattr(self, "_posttrain_identity", None),
                "dtype": dtype_name(self.vllm_config.model_config.dtype)}
