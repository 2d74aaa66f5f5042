"""The shortest wait a setting may ask between two looks at something (a job's state, a folder, a
hot-load): ``1e-300`` passed every ``> 0`` bound and made the loop spin a CPU core. Fifty
milliseconds is faster than anything posttrain polls can change, and keeps a loop's cost small."""

from __future__ import annotations

#: Seconds: the least a poll interval may be (settings say ``ge=MIN_POLL_S``, finite).
MIN_POLL_S = 0.05
