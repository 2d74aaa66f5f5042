"""Error types every package may share; this module imports nothing of posttrain.

``TransientError`` marks a failure that may go away when the same call is made again later
(a service that did not answer, throttled, or did not finish in time). The pipeline's retry
rule (``posttrain.pipeline.tasks.retry``) retries a task on these by type, never by name.
"""

from __future__ import annotations


class TransientError(Exception):
    """A failure worth retrying later: the service did not answer, throttled us, or was too slow."""


__all__ = ["TransientError"]
