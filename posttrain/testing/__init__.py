"""Test-only helpers, never used by a product flow.

- ``crashpoints``: named places where ``POSTTRAIN_CRASH_AT`` makes a process SIGKILL itself (the
  publisher's redo-safe steps call them; they do nothing unless that variable is set);
- ``faultproxy``: an HTTP proxy that fails a share of requests (503s, resets) in front of S3;
- ``synthetic``: synthetic checkpoints and Adam-like updates for tests and benchmarks;
- ``sampler``: a local stand-in for the inference deployment that samples rollouts;
- ``fake_sglang``: an HTTP fake of an SGLang server's API (see docs/sglang-http-api.md).
"""
