"""The ``posttrain`` command.

Each module of this package that defines ``register(subparsers)`` adds its commands. Modules
import only what parsing needs; heavy libraries (torch, Prefect) load inside the command that
uses them, so ``posttrain --help`` and ``posttrain chain ...`` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from posttrain import __version__


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain", description="Nightly RL post-training (GRPO) of language models as a Prefect pipeline."
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
        module = importlib.import_module(f"{__name__}.{mod}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from posttrain.chain.errors import ChainError
    from posttrain.storage.errors import StorageError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ChainError, StorageError, ValidationError) as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
