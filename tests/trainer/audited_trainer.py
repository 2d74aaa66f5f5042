"""``python audited_trainer.py WATCHED_DIR LOG_PREFIX CONFIG.yaml [trainer args]``: the trainer, with every
Python-level write under WATCHED_DIR (open for writing, mkdir, rename, remove, rmtree) recorded in
``LOG_PREFIX<rank>``, one line each. Run under torchrun by the data-parallel tests."""

from __future__ import annotations

import os
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def main() -> int:
    watched = os.path.realpath(sys.argv[1])
    log = open(f"{sys.argv[2]}{os.environ.get('RANK', '0')}", "a", buffering=1)  # noqa: SIM115

    def under(path) -> bool:
        try:
            return os.path.realpath(os.fsdecode(path)).startswith(watched + os.sep)
        except (TypeError, ValueError):
            return False

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if writing and under(path):
                log.write(f"open {path}\n")
        elif event in ("os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.rename", "os.replace"):
            if args and under(args[0]):
                log.write(f"{event} {args[0]}\n")

    sys.addaudithook(hook)
    from posttrain.trainer.__main__ import main as trainer_main

    return trainer_main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
