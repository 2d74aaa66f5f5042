"""``posttrain demo``: the main job on the embedded defaults, on this machine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job end to end on the embedded defaults")
    p.add_argument("--workdir", type=Path, default=Path("runs") / "demo", help="where everything is written")
    p.add_argument("--size-mib", type=int, default=64, help="size of the generated checkpoints")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    import shutil

    from rich.table import Table

    from posttrain.chain.checkpoint import Checkpoint
    from posttrain.chain.ops import reconstruct, verify_chain
    from posttrain.chain.synthetic import adam_like_pair
    from posttrain.chain.writer import ChainWriter
    from posttrain.cli.chain import human_bytes, make_console, progress_bar

    console = make_console()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    console.print(f"[bold]posttrain demo[/] in {work}")
    t0 = time.perf_counter()
    base, new = adam_like_pair(work / "checkpoint-1", work / "checkpoint-2", total_bytes=args.size_mib << 20,
                               lr=1e-6, hidden=512, vocab=16384)
    console.print(f"generated two bf16 checkpoints one Adam step apart in {time.perf_counter() - t0:.1f}s")

    chain = work / "chain"
    writer = ChainWriter(chain, run="demo")
    table = Table(title="snapshots")
    for col in ("step", "snapshot", "kind", "changed tensors", "stored", "% of full", "throughput"):
        table.add_column(col)
    prev = None
    for ckpt in (base, new):
        with progress_bar(f"encoding {ckpt.name}", Checkpoint.open(ckpt).total_bytes) as advance:
            r = writer.add(ckpt, base=prev, progress=advance)
        table.add_row(str(r.step), r.identity, r.kind, f"{r.changed_tensors}/{r.total_tensors}",
                      human_bytes(r.stored_bytes), f"{100 * r.stored_bytes / r.raw_bytes:.2f}",
                      f"{human_bytes(r.raw_bytes / r.seconds)}/s")
        prev = ckpt
    console.print(table)
    verify_chain(chain)
    head = writer.head()
    out = work / "reconstructed"
    rec = reconstruct(chain, head.identity, out)
    same = _same_tensors(out, new)
    console.print(f"chain verified; version {head.identity} reconstructed at "
                  f"{human_bytes(rec.throughput)}/s, bit-exact: {same}")
    console.print(f"results: chain {chain}, reconstructed checkpoint {out}")
    return 0 if same else 1


def _same_tensors(a: Path, b: Path) -> bool:
    from posttrain.chain.checkpoint import Checkpoint, ChunkReader

    ca, cb = Checkpoint.open(a), Checkpoint.open(b)
    if ca.layout() != cb.layout():
        return False
    with ChunkReader() as ra, ChunkReader() as rb:
        for name, info in ca.tensors.items():
            for x, y in zip(ra.chunks(info), rb.chunks(cb.tensors[name]), strict=True):
                if not (x == y).all():
                    return False
    return True
