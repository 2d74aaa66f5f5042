"""Model helpers. ``tiny`` builds a small, deterministic causal LM for offline tests and demos."""
