"""Inference: the hot-load client and the reference inference server (``posttrain serve``).

- ``posttrain.inference.hotload``: ``HotLoadConfig`` and ``CoreWeaveHotLoader``, the client of the
  CoreWeave ``v1alpha1`` hot-load contract (shared/spec/hotload-api.md);
- ``posttrain.inference.weight_loader``: the ``HotLoader`` protocol, ``HotLoadResult`` and errors;
- ``posttrain.inference.other_engines``: notes and stubs for SGLang and vLLM;
- ``posttrain.inference.server``: the reference server (torch and transformers load there only).

Importing this package loads nothing heavy.
"""
