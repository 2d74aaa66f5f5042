"""Publish checkpoints, in step order, as a snapshot chain in an object store.

Every step of a publication is safe to redo, so a publisher killed at any point finishes the
job when it runs again, with no duplicate, missing or half-written version:

1. the checkpoint is spooled into ``work_dir/queue/step-N`` by hard links (rotation of the
   training output cannot delete it); the queue lives on disk, so a restart resumes it;
2. ``ChainWriter`` encodes it under the chain policy (deterministic identity; redoing a step
   whose snapshot exists returns it);
3. the snapshot's files are uploaded, shards first and the index last (the commit marker);
   files already in the store with the same size are not uploaded again;
4. a ledger entry is written and ``latest`` advanced with a conditional write;
5. the local snapshot is removed and the spooled checkpoint becomes the base of the next delta.

``Publisher.publish_step`` publishes one step and returns its snapshot, the one published before
when it is redone; a publisher given ``owns_store=True`` closes its store when it is closed.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.errors import ChainError
from posttrain.chain.format import Flavor
from posttrain.chain.policy import ChainPolicy
from posttrain.chain.writer import ChainWriter, SnapshotRecord
from posttrain.publish.ledger import Latest, Ledger, LedgerEntry, PublishedFile
from posttrain.publish.spool import queued, spool_checkpoint, spool_name
from posttrain.storage import Store
from posttrain.testing.crashpoints import crashpoint


class PublishError(ChainError):
    """Publishing failed; what was published before stays valid."""


class PublishConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(description="Run name; part of every snapshot identity.", min_length=1)
    work_dir: Path = Field(description="Local scratch folder: the spool queue, the base checkpoint, staging.")
    flavor: Flavor = Field(Flavor.COREWEAVE, description="Chain flavour: coreweave or slime.")
    policy: ChainPolicy = Field(default_factory=ChainPolicy, description="When to write a full snapshot.")
    async_publish: bool = Field(True, description="Publish in a background thread; false blocks each submit.")
    queue_size: int = Field(2, ge=1, description="Checkpoints spooled but not yet published before submit blocks.")
    max_shard_size: int = Field(1 << 30, gt=0, description="Shard size limit in bytes.")
    retention: bool = Field(
        False,
        description="Delete chains superseded by a newer full snapshot (keeping the previous chain, which a "
        "consumer may still be reading). Off by default: nothing is ever deleted.",
    )
    workers: int | None = Field(None, ge=1, description="Encoder threads (default: one per core).")


class PublishedSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    identity: str
    kind: str
    base: str | None
    step: int
    stored_bytes: int
    raw_bytes: int
    uploaded_bytes: int = Field(description="Bytes uploaded by this call (0 when all were there already).")
    encode_seconds: float
    upload_seconds: float


class Publisher:
    """Publishes checkpoints of one run to ``store`` (see the module docstring).

    ``owns_store``: ``close()`` (and leaving a ``with Publisher(...)`` block) closes the store too.
    """

    def __init__(self, store: Store, config: PublishConfig,
                 on_published: Callable[[PublishedSnapshot], None] | None = None, *, owns_store: bool = False):
        self.store = store
        self.owns_store = owns_store
        self.config = config
        self.ledger = Ledger(store, config.run)
        self.on_published = on_published
        self.queue_dir = config.work_dir / "queue"
        self.writer = ChainWriter(config.work_dir / "chain", flavor=config.flavor, run=config.run,
                                  policy=config.policy, max_shard_bytes=config.max_shard_size, workers=config.workers)
        self.queue_dir.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.published: list[PublishedSnapshot] = []

    # -- submitting -------------------------------------------------------------------------

    def submit(self, checkpoint: str | Path, step: int | None = None) -> None:
        """Queue a checkpoint; publishes now (sync) or in the background, in step order."""
        from posttrain.chain.ops import checkpoint_step

        self._raise_error()
        checkpoint = Path(checkpoint)
        step = checkpoint_step(checkpoint) if step is None else step
        head = self.writer.head()
        if head is not None and step <= head.step:
            if any(r.step == step for r in self.writer.records()):
                return  # published before: submitting it again is a no-op
            raise PublishError(f"{checkpoint}: step {step} is older than the published step {head.step}")
        with self._cond:
            while len(queued(self.queue_dir)) >= self.config.queue_size and self.config.async_publish:
                self._ensure_thread()
                self._cond.wait(timeout=1.0)
                self._raise_error()
        spool_checkpoint(checkpoint, self.queue_dir / spool_name(step))
        crashpoint("after_spool")
        if self.config.async_publish:
            self._ensure_thread()
            with self._cond:
                self._cond.notify_all()
        else:
            self.resume()

    def publish_step(self, checkpoint: str | Path, step: int) -> PublishedSnapshot:
        """Publish ``checkpoint`` as ``step`` and wait for it; its snapshot. Redo-safe: when the step
        was published before (a retried task, a restarted process) that snapshot is returned and
        nothing is uploaded again. Raises ``PublishError`` when no snapshot of ``step`` exists after."""
        self.submit(checkpoint, step)
        self.drain()
        fresh = [p for p in self.published if p.step == step]
        done = fresh[-1] if fresh else self.snapshot_for_step(step)
        if done is None:
            raise PublishError(f"{checkpoint}: step {step} was not published (no snapshot of it in the ledger "
                               f"of run {self.config.run})")
        return done

    def snapshot_for_step(self, step: int) -> PublishedSnapshot | None:
        """The newest published snapshot of ``step`` (a retried publish finds it here)."""
        for record in reversed(self.writer.records()):
            if record.step != step:
                continue
            entry = self.ledger.get(record.identity)
            if entry is not None:
                return PublishedSnapshot(
                    identity=entry.identity, kind=entry.kind, base=entry.base, step=entry.step,
                    stored_bytes=entry.stored_bytes, raw_bytes=entry.raw_bytes, uploaded_bytes=0,
                    encode_seconds=record.seconds, upload_seconds=0.0,
                )
        return None

    def resume(self) -> list[PublishedSnapshot]:
        """Publish everything spooled (after a crash, too), in step order, in this thread."""
        done = []
        for step, path in queued(self.queue_dir):
            done.append(self._publish_one(step, path))
        return done

    def drain(self) -> list[PublishedSnapshot]:
        """Wait until the queue is empty; raise the background error if there was one."""
        if not self.config.async_publish or self._thread is None:
            self.resume()
        else:
            with self._cond:
                self._cond.notify_all()
                while (queued(self.queue_dir) or self._busy) and self._error is None:
                    self._cond.wait(timeout=0.5)
        self._raise_error()
        return list(self.published)

    def close(self) -> None:
        """Stop the background thread once the queue is empty; close the store when it owns it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            if self._thread is not None:
                self._thread.join()
        finally:
            if self.owns_store:
                self.store.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name="posttrain-publisher", daemon=True)
            self._thread.start()

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not queued(self.queue_dir) and not self._closed:
                    self._cond.wait(timeout=1.0)
                if self._closed and not queued(self.queue_dir):
                    return
                self._busy = True
            try:
                step, path = queued(self.queue_dir)[0]
                self._publish_one(step, path)
            except BaseException as e:  # noqa: BLE001 - surfaced on the next submit or drain
                with self._cond:
                    self._error = e
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise PublishError(f"publishing failed: {self._error}") from self._error

    # -- one checkpoint -------------------------------------------------------------------------

    def _base_checkpoint(self) -> Path | None:
        head = self.writer.head()
        if head is None:
            return None
        base = self.config.work_dir / f"base-{spool_name(head.step)}"
        return base if base.exists() else None

    def _publish_one(self, step: int, spooled: Path, *, restart: bool = False) -> PublishedSnapshot:
        base = None if restart else self._base_checkpoint()
        record = self.writer.add(spooled, base=base, step=step, restart=restart)
        crashpoint("after_encode")
        published = self._publish_record(record)
        self._promote(step, spooled)
        crashpoint("after_promote")
        if self.config.retention and record.kind == "full":
            self._retain()
        self.published.append(published)
        if self.on_published is not None:
            self.on_published(published)
        return published

    def publish_full(self) -> PublishedSnapshot:
        """A full snapshot of the newest published weights, e.g. after an incremental hot-load failed."""
        head = self.writer.head()
        base = self._base_checkpoint()
        if head is None or base is None:
            raise PublishError("nothing published yet: no weights to publish in full")
        record = self.writer.add(base, step=head.step, restart=True)
        published = self._publish_record(record)
        self.published.append(published)
        return published

    def _publish_record(self, record: SnapshotRecord) -> PublishedSnapshot:
        import time

        local = self.writer.chain_dir / record.identity
        t0 = time.perf_counter()
        entry = self.ledger.get(record.identity)
        uploaded = 0
        if entry is None:
            if not local.exists():
                raise PublishError(f"{local}: snapshot {record.identity} is neither on local disk nor in the store")
            files, uploaded = self._upload(local, record.identity)
            entry = LedgerEntry(
                identity=record.identity, kind=record.kind, base=record.base, step=record.step, run=self.config.run,
                files=files, raw_bytes=record.raw_bytes, stored_bytes=sum(f.size for f in files.values()),
                changed_tensors=record.changed_tensors, total_tensors=record.total_tensors, density=record.density,
            )
            self.ledger.put(entry)
        crashpoint("after_ledger")
        self.ledger.advance(Latest(identity=record.identity, step=record.step, kind=record.kind))
        crashpoint("after_latest")
        if local.exists():
            shutil.rmtree(local)
        crashpoint("after_cleanup")
        return PublishedSnapshot(
            identity=record.identity, kind=record.kind, base=record.base, step=record.step,
            stored_bytes=entry.stored_bytes, raw_bytes=record.raw_bytes, uploaded_bytes=uploaded,
            encode_seconds=record.seconds, upload_seconds=time.perf_counter() - t0,
        )

    def _upload(self, local: Path, identity: str) -> tuple[dict[str, PublishedFile], int]:
        names = sorted(p.name for p in local.iterdir() if p.is_file() and p.name != INDEX_NAME)
        shards = [n for n in names if n.endswith(".safetensors")]
        order = shards + [n for n in names if n not in shards] + [INDEX_NAME]
        files: dict[str, PublishedFile] = {}
        uploaded = 0
        for name in order:
            path = local / name
            size = path.stat().st_size
            key = f"{identity}/{name}"
            if name == INDEX_NAME:
                crashpoint("before_index")
            if not (self.store.exists(key) and self.store.size(key) == size):
                self.store.put_file(path, key)
                uploaded += size
            files[name] = PublishedFile(size=size, xxh3_128=_file_digest(path))
            crashpoint("after_index" if name == INDEX_NAME else "after_file")
        return files, uploaded

    def _promote(self, step: int, spooled: Path) -> None:
        """The published checkpoint becomes the base of the next delta; older bases go."""
        base = self.config.work_dir / f"base-{spool_name(step)}"
        if spooled.exists():
            if base.exists():
                shutil.rmtree(spooled)
            else:
                os.rename(spooled, base)
        for p in self.config.work_dir.iterdir():
            if p.name.startswith("base-") and p != base:
                shutil.rmtree(p)

    def _retain(self) -> None:
        """Delete chains older than the previous one (opt-in): never the newest two chains."""
        entries = self.ledger.entries()
        fulls = [e for e in entries if e.kind == "full"]
        if len(fulls) < 3:
            return
        cutoff = fulls[-2]  # the previous chain stays for consumers still reading it
        for e in entries:
            if (e.step, e.published_at) < (cutoff.step, cutoff.published_at):
                # the index goes first: a snapshot without its index does not exist
                self.store.delete([f"{e.identity}/{INDEX_NAME}"])
                self.store.delete([f"{e.identity}/{n}" for n in e.files if n != INDEX_NAME])
                self.ledger.delete(e.identity)
                crashpoint("during_retention")


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def published_steps(store: Store, run: str) -> dict[int, list[str]]:
    """Step -> identities in the run's ledger (more than one means a duplicate)."""
    out: dict[int, list[str]] = {}
    for e in Ledger(store, run).entries():
        out.setdefault(e.step, []).append(e.identity)
    return out


__all__ = ["PublishConfig", "PublishError", "PublishedSnapshot", "Publisher", "published_steps"]
