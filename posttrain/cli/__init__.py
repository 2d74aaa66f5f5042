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

from posttrain import __version__, redact


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser that names an unknown option before a missing subcommand.

    argparse checks required subcommands inside ``parse_known_args``, before ``parse_args`` looks
    at what was left over, so ``posttrain --bogus`` would say COMMAND is required. Subparsers
    are created with the parent's class, so every level behaves the same way.
    """

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        subs = [a for a in self._actions
                if isinstance(a, argparse._SubParsersAction) and a.required and a.dest != argparse.SUPPRESS]
        for a in subs:
            a.required = False
        try:
            ns, extras = super().parse_known_args(args, namespace)
        finally:
            for a in subs:
                a.required = True
        missing = [a for a in subs if getattr(ns, a.dest, None) is None]
        if missing:
            if extras:
                self.error(f"unrecognized arguments: {' '.join(extras)}")
            self.error(f"the following arguments are required: {missing[0].metavar or missing[0].dest}")
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    """Run one command. Every error it prints goes through ``posttrain.redact.scrub``: S3 credentials
    (configured or from the environment), a job's secrets and URL userinfo never show."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as e:
        if _loaded_class("pydantic_core", "ValidationError", e):  # one line, not pydantic's dump
            from posttrain.errors import validation_problems

            problems = validation_problems(e)  # a model-level check's message names its fields itself
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            # one built with no errors (ValidationError.from_exception_data(title, [])) names none
            line = f"{e.title}: {problems[0]}{more}" if problems else f"{e.title}: is not valid (no problem was named)"
            print(f"posttrain: error: {redact.scrub(line)}", file=sys.stderr)
            return 2
        if isinstance(e, UsageError) or _loaded_class("posttrain.chain.errors", "ChainError", e) or _loaded_class(
            "posttrain.storage.errors", "StorageError", e
        ):
            print(f"posttrain: error: {redact.scrub(e)}", file=sys.stderr)
            return 2
        redact.scrub_exception(e)  # its traceback, printed by Python, shows no secret either
        raise
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        return 130


def _loaded_class(module: str, name: str, error: BaseException) -> bool:
    """Whether ``error`` is a ``module.name``, without importing the module: an error of a module no
    command loaded cannot have been raised. (pydantic and the stores take ~0.1 s to import, a third
    of what a codec command on a small checkpoint costs.)"""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(error, getattr(loaded, name))


if __name__ == "__main__":
    sys.exit(main())
