"""Tasks with verifiable rewards for GRPO: seeded prompt rows (disjoint train and eval splits) and the
reward functions that score them, by name (docs/tasks.md).

``get_task("arithmetic").write_jsonl(path, "train", 512, seed=0)`` writes a file ``stage_dataset``
accepts; ``task.reward_funcs`` and ``task.reward_weights`` are a trainer's ``reward_funcs`` and
``reward_weights``. Pure Python: no torch.
"""

from __future__ import annotations

from posttrain.tasks.arithmetic import TASK as ARITHMETIC
from posttrain.tasks.base import EVAL_PERCENT, SPLITS, Split, Task, split_of
from posttrain.tasks.instruct import TASK as LENGTH

TASKS: dict[str, Task] = {task.name: task for task in (ARITHMETIC, LENGTH)}


def get_task(name: str) -> Task:
    """The task called ``name``; a ValueError listing the known names otherwise."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


__all__ = ["EVAL_PERCENT", "SPLITS", "TASKS", "Split", "Task", "get_task", "split_of"]
