"""bench/growth.py store: what the store-wide commands read, against the number of snapshots.

A folder store is filled by the real ``Publisher`` (runs of ``--steps-per-run`` tiny synthetic
checkpoints, chains of at most 3 deltas) with a promotion history for each of three deployments
(``History.append``: ``--records`` decisions each, every third a refusal, on snapshots spread
over the store; the same number at every size, so that what grows is the store alone). Then, on that store:

- ``gc --dry-run``: ``posttrain gc --keep-runs 3 --dry-run`` (the CLI, in process);
- ``history``: ``posttrain history --deployment prod``;
- ``chain inspect``: ``posttrain chain inspect <store folder>`` (every snapshot of the folder);
- ``champion lookup``: what a promotion reads before its evals and again under production's lease
  (``promote``'s first steps: the history, the champion's index; the lease, gc's leases);
- ``rollback``: ``rollback(--to previous)`` of the promoter, the hot-load being a rebuild of the
  target from the store (``reconstruct_from_store``: the fetch of its chain and the apply).

Besides the time, each row counts what the operation read from the store, a measure that does not
depend on the machine: ``list`` calls, keys those calls returned, objects read and their bytes
(a store wrapper). ``chain inspect`` reads the folder itself, not through a store: for it, folder
scans and files opened under the store's root (Python's audit hooks). Each row also says what the
operation must read (``must``: snapshots, history records, chain length) so that the growth of what
it reads can be set against the growth of what it has to.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import growth_common as gc_common

SIZES = (10, 100, 1000)
STEPS_PER_RUN = 10  # 1,000 snapshots = 100 runs
RECORDS = 20  # decisions in each deployment's history, at every size
DEPLOYMENTS = ("prod", "prod-eu", "canary")
OPERATIONS = ("gc --dry-run", "history", "chain inspect", "champion lookup", "rollback")


@dataclass
class Reads:
    """What an operation read: list calls, keys they returned, objects read, their bytes."""

    lists: int = 0
    keys_listed: int | None = 0
    reads: int = 0
    bytes_read: int | None = 0

    @property
    def touched(self) -> int:
        """Keys listed plus objects read: the figure compared with what the operation must read."""
        return (self.keys_listed or 0) + self.reads


def counting(inner, reads: Reads):  # noqa: ANN001, ANN201 - a Store, and a Store counting into reads
    """``inner`` with every read counted into ``reads`` (writes pass through uncounted)."""
    from posttrain.storage import Store

    class Counting(Store):
        uri = property(lambda self: inner.uri)

        def put_file(self, local_path, key):  # noqa: ANN001, ANN202
            return inner.put_file(local_path, key)

        def put_bytes(self, key, data, **kw):  # noqa: ANN001, ANN003, ANN202
            return inner.put_bytes(key, data, **kw)

        def delete(self, keys):  # noqa: ANN001, ANN202
            return inner.delete(keys)

        def get_file(self, key, local_path):  # noqa: ANN001, ANN202
            inner.get_file(key, local_path)
            reads.reads += 1
            reads.bytes_read += Path(local_path).stat().st_size

        def get_bytes(self, key):  # noqa: ANN001, ANN202
            data, etag = inner.get_bytes(key)
            reads.reads += 1
            reads.bytes_read += len(data)
            return data, etag

        def exists(self, key):  # noqa: ANN001, ANN202
            reads.reads += 1  # a HEAD on S3
            return inner.exists(key)

        def size(self, key):  # noqa: ANN001, ANN202
            reads.reads += 1
            return inner.size(key)

        def list(self, prefix=""):  # noqa: ANN001, ANN202
            reads.lists += 1
            for key in inner.list(prefix):
                reads.keys_listed += 1
                yield key

        def close(self) -> None:
            inner.close()

    return Counting()


# ---- what reads a folder, not a store: Python's audit hooks ------------------------------------
_FOLDER: tuple[str, Reads] | None = None  # (root, counts) while an operation on a folder is measured


def _audit(event: str, args: tuple) -> None:
    if _FOLDER is None or event not in ("open", "os.scandir", "os.listdir"):
        return
    root, reads = _FOLDER
    path = args[0] if args else None
    if not isinstance(path, (str, Path)) or not str(path).startswith(root):
        return
    if event == "open":
        reads.reads += 1
    else:
        reads.lists += 1


@contextlib.contextmanager
def folder_reads(root: Path):  # noqa: ANN201 - yields the Reads being counted
    """Count folder scans and files opened under ``root`` while the block runs (this thread and others)."""
    global _FOLDER
    if not getattr(folder_reads, "hooked", False):
        sys.addaudithook(_audit)  # cannot be removed: it does nothing while _FOLDER is None
        folder_reads.hooked = True
    reads = Reads(keys_listed=None, bytes_read=None)
    _FOLDER = (str(root), reads)
    try:
        yield reads
    finally:
        _FOLDER = None


# ---- building a store ----------------------------------------------------------------------------
@dataclass
class Built:
    root: Path  # the folder store
    snapshots: int
    runs: int
    records: dict[str, int]  # deployment -> history records


def _checkpoints(out: Path, seed: int, steps: int) -> list[Path]:
    """``steps`` tiny checkpoints (two 32x32 bf16 tensors), a few values changing per step."""
    from posttrain.testing.synthetic import run_checkpoints

    return run_checkpoints(out, seed, steps, tensors=2, side=32, changed=16)


def _decide(history, candidate: str) -> None:  # noqa: ANN001 - a History
    """The gate's record for ``candidate``: a promotion, every third record (and one of the champion
    itself) a refusal."""
    from posttrain.promote.decision import Decision
    from posttrain.promote.history import Record, champions

    records = history.records()
    champion = (champions(records) or [None])[-1]
    accepted = champion is None or (candidate != champion and len(records) % 3 != 2)
    decision = Decision(accepted=accepted, reason="accepted" if accepted else "refused", rule="superiority",
                        margin=0.0, confidence=0.95, bootstrap_samples=1000, seed=0, candidate=candidate,
                        champion=champion, prompts=16, samples_per_prompt=4)
    history.append(Record(kind="promotion" if accepted else "refusal", deployment=history.deployment,
                          identity=candidate, previous=champion, run="nightly", decision=decision,
                          reason="accepted: better" if accepted else "refused: not better"))


def build_store(root: Path, snapshots: int, *, steps_per_run: int = STEPS_PER_RUN,
                records: int = RECORDS) -> Built:
    """A folder store of ``snapshots`` snapshots in runs of ``steps_per_run``, published by the real
    Publisher, and a history of ``records`` decisions per deployment, whatever the store's size (so
    that what grows between sizes is the store alone), on snapshots spread over the whole store."""
    from posttrain.storage import LocalStore

    with mock.patch("os.fsync", lambda fd: None):  # durability is not measured here: building need not wait on disks
        return _build(LocalStore(root / "store"), root, snapshots, steps_per_run, records)


def _build(store, root: Path, snapshots: int, steps_per_run: int, records: int) -> Built:  # noqa: ANN001
    from posttrain.chain.policy import ChainPolicy
    from posttrain.promote.history import History
    from posttrain.publish import PublishConfig, Publisher

    runs: list[list[str]] = []  # each run's identities, in step order
    while (published := sum(map(len, runs))) < snapshots:
        run, steps = f"night-{len(runs):04d}", min(steps_per_run, snapshots - published)
        config = PublishConfig(run=run, work_dir=root / "work" / run, async_publish=False, workers=1,
                               policy=ChainPolicy(max_deltas=3))
        with Publisher(store, config) as pub:
            runs.append([pub.publish_step(c, s).identity
                         for s, c in enumerate(_checkpoints(root / "ckpt" / run, len(runs), steps), start=1)])
    for offset, deployment in enumerate(DEPLOYMENTS):
        history = History(store, "", deployment)
        for i in range(records):  # record i: the same step of a run at every size, so the same chain length
            chosen = runs[i * len(runs) // records]
            _decide(history, chosen[(i + offset) % len(chosen)])
    return Built(store.root, published, len(runs), {d: records for d in DEPLOYMENTS})


# ---- the operations ---------------------------------------------------------------------------
def _cli(argv: list[str], reads: Reads) -> None:
    """``posttrain ARGV`` in this process, its store counted; its output thrown away."""
    import posttrain.storage
    from posttrain.cli import main

    real = posttrain.storage.open_store
    with mock.patch.object(posttrain.storage, "open_store", lambda uri, **kw: counting(real(uri, **kw), reads)), \
            contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    if status != 0:
        raise SystemExit(f"posttrain {' '.join(argv)}: exit status {status}")


class RebuildLoader:
    """A hot-loader whose deployment rebuilds the version from the store, as a server does."""

    def __init__(self, store, work: Path):  # noqa: ANN001
        self.store, self.work = store, work

    def hot_load(self, identity: str, *, base_identity: str | None = None, publish_full=None):  # noqa: ANN001, ANN201
        from posttrain.chain.fetch import reconstruct_from_store
        from posttrain.inference.contract import HotLoadResult

        stamp = time.monotonic_ns()
        reconstruct_from_store(self.store, identity, self.work / f"out-{stamp}", cache_dir=self.work / f"cache-{stamp}")
        return HotLoadResult(operation_id=str(stamp), identity=identity, snapshot_type="full", state="COMPLETED",
                             seconds=0.0, replicas=[], attempts=1)


def champion_lookup(store, deployment: str) -> str | None:  # noqa: ANN001 - a Store
    """What ``promote`` reads about the champion: before its evals, and again under the lease."""
    from posttrain.promote.history import History, champions
    from posttrain.promote.promoter import Deployment, _check_unchanged, _deployment_held, check_champion

    champion = (champions(History(store, "", deployment).records()) or [None])[-1]
    check_champion(store, deployment, champion)
    production = Deployment(deployment, RebuildLoader(store, Path(tempfile.gettempdir())))
    with _deployment_held(store, production, "promotion", "bench", ttl=60.0, gc_wait=0.0, log=lambda _: None) \
            as (_, history):
        _check_unchanged(history, champion, "bench")
    return champion


def measure_operation(built: Built, operation: str, work: Path) -> dict:
    """One row: the operation's seconds and what it read from the store built."""
    from posttrain.promote.promoter import Deployment, rollback
    from posttrain.storage import LocalStore

    reads = Reads()
    records = built.records["prod"]
    must = {"gc --dry-run": built.snapshots + sum(built.records.values()), "history": records,
            "chain inspect": built.snapshots, "champion lookup": records + 1}
    t0 = time.perf_counter()
    if operation == "gc --dry-run":
        _cli(["gc", "--store", str(built.root), "--keep-runs", "3", "--dry-run"], reads)
    elif operation == "history":
        _cli(["history", "--store", str(built.root), "--deployment", "prod"], reads)
    elif operation == "chain inspect":
        with folder_reads(built.root) as reads:
            _cli(["chain", "inspect", str(built.root)], reads)
    elif operation == "champion lookup":
        champion_lookup(counting(LocalStore(built.root), reads), "prod")
    elif operation == "rollback":
        store = counting(LocalStore(built.root), reads)
        production = Deployment("prod", RebuildLoader(store, work))
        done = rollback(store=store, production=production, to="previous", run="bench-rollback", gc_wait=0.0)
        chain = _chain_length(LocalStore(built.root), done.record.identity)
        must[operation] = records + chain
    else:
        raise ValueError(f"unknown operation {operation!r}")
    seconds = time.perf_counter() - t0
    return {"snapshots": built.snapshots, "runs": built.runs, "operation": operation, "seconds": seconds,
            **asdict(reads), "touched": reads.touched, "must": must[operation]}


def _chain_length(store, identity: str) -> int:  # noqa: ANN001
    from posttrain.chain.fetch import SnapshotSource

    with tempfile.TemporaryDirectory() as tmp:
        return len(SnapshotSource(store, "", Path(tmp)).plan(identity, held=None).snapshots)


def measure_store(sizes: tuple[int, ...] = SIZES, root: Path | None = None, *, steps_per_run: int = STEPS_PER_RUN,
                  records: int = RECORDS, operations: tuple[str, ...] = OPERATIONS) -> list[dict]:
    """Rows {snapshots, runs, operation, seconds, lists, keys_listed, reads, bytes_read, touched, must}:
    a fresh store per size (``build_store``), each operation once on it (after an untimed warm-up
    run of the read-only ones), ``rollback`` last (it writes a record)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="growth-store-", dir=root) as tmp:
        for n in sizes:
            t0 = time.perf_counter()
            built = build_store(Path(tmp) / f"n{n}", n, steps_per_run=steps_per_run, records=records)
            print(f"built {n} snapshots, {built.runs} runs, {built.records['prod']} records per history "
                  f"in {time.perf_counter() - t0:.1f}s", flush=True)
            for op in operations:  # once untimed, so imports and cold caches are not the small store's
                if op != "rollback":
                    measure_operation(built, op, Path(tmp) / f"n{n}" / "rebuild")
            for op in sorted(operations, key=lambda o: o == "rollback"):
                rows.append(measure_operation(built, op, Path(tmp) / f"n{n}" / "rebuild"))
    return rows


def growth(rows: list[dict]) -> list[dict]:
    """Per operation, smallest to largest store: growth of seconds, of what it read (touched) and of
    what it must read, and a verdict (reads growing over 1.5x faster than the work: 'grows faster')."""
    out = []
    for op in dict.fromkeys(r["operation"] for r in rows):
        mine = sorted((r for r in rows if r["operation"] == op), key=lambda r: r["snapshots"])
        small, large = mine[0], mine[-1]
        read_growth = gc_common.ratio(large["touched"], small["touched"])
        must_growth = gc_common.ratio(large["must"], small["must"])
        verdict = "in proportion" if read_growth <= 1.5 * must_growth else "grows faster than the work"
        out.append({"operation": op, "snapshots": f"{small['snapshots']} -> {large['snapshots']}",
                    "time": gc_common.ratio(large["seconds"], small["seconds"]), "read": read_growth,
                    "must": must_growth, "verdict": verdict})
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--snapshots", type=int, nargs="+", default=list(SIZES),
                        help="store sizes in snapshots (default 10 100 1000: 1, 10 and 100 runs)")
    parser.add_argument("--steps-per-run", type=int, default=STEPS_PER_RUN, help="snapshots per run (default 10)")
    parser.add_argument("--records", type=int, default=RECORDS, help="records in each deployment's history (default 20)")
    parser.add_argument("--tmp", type=Path, help="folder for the stores (default: the system's temporary folder)")


def main(args: argparse.Namespace) -> None:
    print(gc_common.machine(), flush=True)
    rows = measure_store(tuple(args.snapshots), args.tmp, steps_per_run=args.steps_per_run,
                         records=args.records)
    header = ("snapshots", "operation", "seconds", "lists", "keys listed", "reads", "bytes read", "must read")
    gc_common.table("Store operations against the store's size (a folder store; chain inspect: folder scans "
                    "and files opened)", header,
                    [(r["snapshots"], r["operation"], r["seconds"], r["lists"], _dash(r["keys_listed"]), r["reads"],
                      _dash(r["bytes_read"]), r["must"]) for r in rows])
    print()
    summary = growth(rows)
    gc_common.table("Growth from the smallest to the largest store (read: keys listed + objects read)",
                    ("operation", "snapshots", "time x", "read x", "must read x", "verdict"),
                    [(g["operation"], g["snapshots"], g["time"], g["read"], g["must"], g["verdict"]) for g in summary])
    series = {op: ([r["snapshots"] for r in rows if r["operation"] == op],
                   [r["seconds"] for r in rows if r["operation"] == op]) for op in OPERATIONS}
    gc_common.plot("store", "Store operations against the store's size", "snapshots in the store", series,
                   "seconds", logx=True)
    print(f"rows: {gc_common.save('store', {'rows': rows, 'growth': summary})}")


def _dash(value: int | None) -> object:
    return "-" if value is None else value
