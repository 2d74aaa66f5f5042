"""Prefect tasks: each a few lines that load a block and call an engine (runs, publish, inference,
rollouts, datasets); artifacts (report) and which failures are retried (retry)."""
