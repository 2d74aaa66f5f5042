"""The reference inference server (``posttrain serve``), a separate program.

It serves ``/v1/completions`` (token ids and logprobs) from a transformers model and speaks the
CoreWeave ``v1alpha1`` hot-load API: ``server`` (HTTP), ``hotload_service`` (operations, fetching
from the store, rebuilding a version), ``model_slot`` (the served model and its atomic swap),
``sampler`` and ``completions`` (sampling and the OpenAI-style request/response), ``faults``
(faults a test asks for over HTTP), ``serve_config``. torch loads here only.
"""
