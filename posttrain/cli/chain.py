"""``posttrain chain``: encode, apply, verify and inspect checkpoint chains."""

from __future__ import annotations

import argparse
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from posttrain.cli.s3_args import add_s3_options, s3_options
from posttrain.words import plural

SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    m = SIZE_RE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512MiB or 1GiB")
    factor = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * factor)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def make_console():
    """A rich console; wide when output is not a terminal, so identities are not cut."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def register(sub: argparse._SubParsersAction) -> None:
    chain = sub.add_parser("chain", help="encode, apply, verify and inspect checkpoint chains")
    csub = chain.add_subparsers(dest="chain_command", metavar="SUBCOMMAND", required=True)

    enc = csub.add_parser("encode", help="write a full snapshot, or a delta against --base, into a chain folder")
    enc.add_argument("new", type=Path, help="Hugging Face checkpoint folder of the new weights")
    enc.add_argument("--out", type=Path, required=True, help="chain folder; the snapshot goes to OUT/<identity>")
    enc.add_argument("--base", type=Path, help="checkpoint folder of the previous weights (writes a delta)")
    enc.add_argument("--flavor", choices=["coreweave", "slime"], default="coreweave")
    enc.add_argument("--identity", help="snapshot identity (slime: version number); default: deterministic")
    enc.add_argument("--base-identity", help="identity of the snapshot the delta builds on")
    enc.add_argument("--step", type=int, help="training step (default: from checkpoint-N or trainer_state.json)")
    enc.add_argument("--run", help="run name that goes into the deterministic identity (default: chain folder name)")
    enc.add_argument("--max-shard-size", type=parse_size, default=1 << 30, help="shard size limit (default 1GiB)")
    enc.add_argument("--workers", type=int, help="threads (default: one per core)")
    enc.set_defaults(func=cmd_encode)

    app = csub.add_parser("apply", help="reconstruct a version of a chain into a Hugging Face checkpoint")
    app.add_argument("chain", help="chain folder, or a store: s3://bucket/prefix (credentials from the environment)")
    app.add_argument("--version", required=True, help="identity (or slime version) to reconstruct")
    app.add_argument("--out", type=Path, required=True, help="output checkpoint folder (must not exist)")
    app.add_argument("--from", dest="held", type=Path, help="checkpoint already holding a version on the path "
                     "(a folder chain apply wrote): only the deltas after it are applied, so CHAIN needs only those")
    app.add_argument("--boot", type=Path, help="slime: the engine's boot weights (version 0)")
    app.add_argument("--workers", type=int)
    app.add_argument("--no-fsync", dest="durable", action="store_false",
                     help="do not wait for the output to reach the disk (faster; after a power cut the folder may "
                     "hold torn files: for a copy you would rebuild, as a hot-load does)")
    app.add_argument("--cache", type=Path, help="with a store: where downloaded snapshots are kept "
                     "(default ~/.cache/posttrain/chains)")
    add_s3_options(app)  # with an s3:// store
    app.set_defaults(func=cmd_apply)

    ver = csub.add_parser("verify", help="check every snapshot and every delta checksum of a chain")
    ver.add_argument("chain", type=Path)
    ver.add_argument("--boot", type=Path, help="slime: the engine's boot weights (version 0)")
    ver.add_argument("--workers", type=int)
    ver.set_defaults(func=cmd_verify)

    ins = csub.add_parser("inspect", help="list a chain's snapshots: kind, base, changed tensors, sizes")
    ins.add_argument("chain", type=Path)
    ins.add_argument("--density", action="store_true", help="decompress deltas to measure the bytes they change")
    ins.set_defaults(func=cmd_inspect)


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A transient rich bar on a terminal's stderr; no bar (and no rich to import) otherwise."""
    import sys

    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def codec_process() -> None:
    """Before numpy loads: one OpenBLAS thread. The codec makes no BLAS calls, and OpenBLAS's idle
    helper threads spin for a while after import, taking cores from the codec's own threads."""
    import os
    import sys

    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def cmd_encode(args: argparse.Namespace) -> int:
    codec_process()
    from posttrain.chain.checkpoint import Checkpoint
    from posttrain.chain.ops import encode_snapshot

    total = Checkpoint.open(args.new).total_bytes
    with progress_bar("encoding", total) as advance:
        r = encode_snapshot(
            args.new, args.out, base_dir=args.base, flavor=args.flavor, identity=args.identity,
            base_identity=args.base_identity, step=args.step, run=args.run,
            max_shard_bytes=args.max_shard_size, workers=args.workers, progress=advance,
        )
    against = f" against {r.base}" if r.base else ""
    print(
        f"{r.kind} snapshot {r.identity}{against}: {r.changed_tensors}/{r.total_tensors} tensors changed, "
        f"{human_bytes(r.stored_bytes)} = {100 * r.share_of_full:.2f}% of full, density "
        f"{100 * r.density:.2f}%, {human_bytes(r.throughput)}/s -> {r.path}"
    )
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    codec_process()
    from posttrain.chain.errors import ChecksumMismatch, FormatError
    from posttrain.chain.ops import reconstruct

    chain, fetched = Path(args.chain), []
    held = _held_version(args.held)
    if "://" in args.chain:
        chain, fetched = _fetch_from_store(args, held)
    try:
        total = _version_bytes(chain, args.version, held, args.held, args.boot)
        with progress_bar("applying", total) as advance:
            r = reconstruct(chain, args.version, args.out, held_dir=args.held, boot_dir=args.boot,
                            workers=args.workers, progress=advance, durable=args.durable)
    except (ChecksumMismatch, FormatError):
        for name in fetched:  # a damaged cached copy: the next run downloads it again
            shutil.rmtree(chain / name, ignore_errors=True)
        raise
    print(
        f"version {r.version}: {r.start} + {plural(len(r.deltas), 'delta')}, {human_bytes(r.bytes)} verified, "
        f"{human_bytes(r.throughput)}/s -> {r.path}"
    )
    return 0


def _held_version(held_dir: Path | None) -> str | None:
    """The version a --from folder holds (None without one, or when it records none: reconstruct says so)."""
    from posttrain.chain.checkpoint import Checkpoint
    from posttrain.chain.snapshot import held_version

    return held_version(Checkpoint.open(held_dir)) if held_dir is not None else None


def _fetch_from_store(args: argparse.Namespace, held: str | None) -> tuple[Path, list[str]]:
    """Download the snapshots the version needs (after ``held``) into a local cache folder; that folder and them."""
    import hashlib

    from posttrain.chain.fetch import SnapshotError, SnapshotSource
    from posttrain.cli import UsageError
    from posttrain.storage import open_store

    options = s3_options(args)
    cache = args.cache or Path.home() / ".cache" / "posttrain" / "chains" / hashlib.sha1(args.chain.encode()).hexdigest()[:16]
    with open_store(args.chain, **options) as store:
        source = SnapshotSource(store, "", cache)
        try:
            names = source.plan(args.version, held=held).snapshots
            for name in names:
                source.fetch(name)
        except SnapshotError as e:  # a version not in the store: one line naming it and the store
            raise UsageError(str(e)) from None
    return cache, names


def _version_bytes(chain: Path, version: str, held: str | None, held_dir: Path | None, boot: Path | None) -> int:
    """The progress bar's total: the bytes of the version the deltas start from."""
    from posttrain.chain.checkpoint import Checkpoint
    from posttrain.chain.errors import MissingBase
    from posttrain.chain.folder import ChainFolder

    folder = ChainFolder(chain)
    try:
        full, _ = folder.resolve(folder.find(version).name, held=held)
    except MissingBase:
        return 0  # reconstruct refuses it, naming the delta and the held version
    start = full.path if full is not None else (held_dir or boot)
    return Checkpoint.open(start).total_bytes if start is not None else 0


def cmd_verify(args: argparse.Namespace) -> int:
    codec_process()
    from posttrain.chain.folder import ChainFolder
    from posttrain.chain.ops import verify_chain
    from posttrain.cli import UsageError

    chain = ChainFolder(args.chain)
    total = sum(1 for _ in chain.ordered())
    if total == 0:
        raise UsageError(f"{args.chain} holds no snapshots (subfolders with an index); it is not a chain folder")
    paths = verify_chain(args.chain, boot_dir=args.boot, workers=args.workers)
    deltas = sum(len(p.deltas) for p in paths)
    print(f"{args.chain}: OK, {plural(total, 'snapshot')}, {plural(len(paths), 'path')}, {plural(deltas, 'delta')} "
          "verified")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from posttrain.chain.ops import inspect_chain

    rows = inspect_chain(args.chain, density=args.density)
    runs = snapshot_runs(args.chain)  # a store's folder: several runs' chains side by side
    if runs:
        rows.sort(key=lambda s: ",".join(runs.get(s.name, ())))  # each run's snapshots together, in step order
    table = Table(title=str(args.chain))
    columns = ("snapshot", "kind", "base", "changed tensors", "density %", "stored", "% of full")
    for col in ("run", *columns) if runs else columns:
        table.add_column(col, justify="left" if col in ("run", "snapshot", "kind", "base") else "right")
    for s in rows:
        dens = f"{100 * s.density:.2f}" if s.density is not None else "-"
        cells = [s.name, s.kind, s.base or "-", f"{s.changed_tensors}/{s.total_tensors}", dens,
                 human_bytes(s.stored_bytes), "-" if s.share_of_full is None else f"{100 * s.share_of_full:.2f}"]
        table.add_row(*([", ".join(runs.get(s.name, ())) or "-"] if runs else []), *cells)
    table.caption = "% of full: stored bytes over those of the full snapshot the version builds on"
    make_console().print(table)
    return 0


def snapshot_runs(folder: Path) -> dict[str, list[str]]:
    """Snapshot identity -> the runs whose ledger lists it, for a folder store (its ledgers under
    ``.posttrain/runs/``); empty for a chain folder that no run published to."""
    from posttrain.publish.gc import run_names
    from posttrain.publish.ledger import Ledger
    from posttrain.storage import LocalStore

    runs: dict[str, list[str]] = {}
    with LocalStore(folder) as store:
        for run in run_names(store):
            for entry in Ledger(store, run).entries():
                runs.setdefault(entry.identity, []).append(run)
    return runs
