"""Reading TensorBoard event files back, with TensorBoard's own reader."""

from __future__ import annotations


def scalar_curves(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve of a TensorBoard log folder (all its event files, as TensorBoard shows one
    run): tag -> [(step, value), ...] by step, as TensorBoard plots it (its reader takes a folder's
    files in name order, which is not always the order written: the rounds of one run, a process
    each, were read back as 1, 2, 0 once in CI)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
