"""Publish checkpoints, in step order, as a snapshot chain in an object store.

Every step of a publication is safe to redo, so a publisher killed at any point finishes the
job when it runs again, with no duplicate, missing or half-written version:

0. the run's flavour and chain policy are recorded in the store on its first publication; a
   publisher with others is refused (they decide identities, and a step has one identity);
1. the checkpoint is spooled into ``work_dir/queue/step-N`` by hard links (rotation of the
   training output cannot delete it); the queue lives on disk, so a restart resumes it;
2. ``ChainWriter`` encodes it under the chain policy (deterministic identity; redoing a step
   whose snapshot exists returns it);
3. the snapshot's files are uploaded, shards first and the index last (the commit marker);
   files already in the store with the same size are not uploaded again;
4. a ledger entry is written, the step claimed (``if_none_match``: its one snapshot and the
   digest of its weights) and ``latest`` advanced with a conditional write;
5. the local snapshot is removed and the spooled checkpoint becomes the base of the next delta.

A checkpoint submitted for a step that is claimed already is compared with the claim: the same
weights are a no-op (retries rely on it), other weights an error. A step comes from the folder
(``chain.ops.checkpoint_step``) unless given. One publisher works in a work folder at a time (``lock``);
each step holds the run's publisher lease in the store, which keeps ``posttrain gc`` off the run (``lease``).

``Publisher.publish_step`` publishes one step and returns its snapshot, the one published before
when it is redone; a publisher given ``owns_store=True`` closes its store when it is closed.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.chain.errors import ChainError
from posttrain.chain.format import Flavor
from posttrain.chain.ops import checkpoint_step
from posttrain.chain.policy import ChainPolicy
from posttrain.chain.writer import ChainWriter, SnapshotRecord
from posttrain.errors import describe_os_error, file_in_the_way, naming
from posttrain.publish.content import checkpoint_content, head_content
from posttrain.publish.lease import base_retired, publishing
from posttrain.publish.ledger import (
    Latest,
    Ledger,
    LedgerEntry,
    RunSettings,
    StepClaim,
    check_run_name,
    published_steps,
)
from posttrain.publish.lock import WorkDirLock
from posttrain.publish.spool import promote_base, queued, spool_checkpoint, spool_name
from posttrain.publish.transfer import retire_old_chains, upload_snapshot
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
    lock_timeout: float = Field(0.0, ge=0, description="Seconds to wait for another publisher to leave the work "
                                "folder; 0 fails at once, naming the holder's pid.")

    @field_validator("run")
    @classmethod
    def _run_name(cls, v: str) -> str:
        try:
            return check_run_name(v)
        except ChainError as e:
            raise ValueError(str(e)) from None


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
        work_dir = config.work_dir
        if (file := file_in_the_way(work_dir)) is not None:  # mkdir would say only "Not a directory"
            raise PublishError(f"work dir {work_dir} is not a folder" if file == work_dir
                               else f"work dir {work_dir}: {file} is a file, not a folder")
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
            self._lock = WorkDirLock(work_dir, timeout=config.lock_timeout)
        except OSError as e:
            raise PublishError(f"work dir {work_dir}: {describe_os_error(e)}") from None
        try:
            self.queue_dir.mkdir(parents=True, exist_ok=True)
        except BaseException:
            self._lock.release()
            raise
        self._settings_checked = False
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.published: list[PublishedSnapshot] = []

    # -- submitting -------------------------------------------------------------------------

    def submit(self, checkpoint: str | Path, step: int | None = None) -> StepClaim | None:
        """Queue a checkpoint; publishes now (sync) or in the background, in step order.

        Returns the step's claim, queuing nothing, when the step was published with these weights
        before; raises ``PublishError`` when it was published with others (see the module docstring).
        """
        self._raise_error()
        checkpoint = Path(checkpoint)
        if not checkpoint.is_dir():
            raise PublishError(f"checkpoint {checkpoint} {'is not a folder' if checkpoint.exists() else 'does not exist'}")
        step = checkpoint_step(checkpoint) if step is None else step
        if step < 0:
            raise PublishError(f"{checkpoint}: step {step} is negative")
        self._check_settings()
        if (claim := self._published_as(checkpoint, step)) is not None:
            return claim  # published before with the same weights: a no-op (retries rely on it)
        if not self._queued_already(checkpoint, step):
            newest = max((s.step for s in (self.writer.head(), self.ledger.latest()[0]) if s is not None), default=-1)
            if step <= newest:
                if (claim := self._published_as(checkpoint, step)) is not None:
                    return claim  # published by the background thread meanwhile
                raise PublishError(f"{checkpoint}: step {step} is not after the published step {newest} of run "
                                   f"{self.config.run}, and was never published itself")
        with self._cond:
            while len(queued(self.queue_dir)) >= self.config.queue_size and self.config.async_publish:
                self._ensure_thread()
                self._cond.wait(timeout=1.0)
                self._raise_error()
        with naming(self.queue_dir):
            spool_checkpoint(checkpoint, self.queue_dir / spool_name(step))
        crashpoint("after_spool")
        if self.config.async_publish:
            self._ensure_thread()
            with self._cond:
                self._cond.notify_all()
        else:
            self.resume()
        return None

    def _check_settings(self) -> None:
        if not self._settings_checked:
            self.ledger.claim_settings(RunSettings(flavor=self.config.flavor.value, policy=self.config.policy))
            self._settings_checked = True

    def _published_as(self, checkpoint: Path, step: int) -> StepClaim | None:
        """The step's claim when it was published with the checkpoint's weights; an error with others."""
        claim = self.ledger.claim(step)
        if claim is not None and checkpoint_content(checkpoint) != claim.content:
            raise PublishError(f"{checkpoint}: step {step} of run {self.config.run} is already published as "
                               f"{claim.identity} with different weights; nothing was published")
        return claim

    def _queued_already(self, checkpoint: Path, step: int) -> bool:
        """The step is spooled, not yet published: with the same weights (else an error)."""
        spooled = self.queue_dir / spool_name(step)
        if not spooled.exists():
            return False
        if checkpoint_content(spooled) != checkpoint_content(checkpoint):
            raise PublishError(f"{checkpoint}: step {step} is already queued in {spooled} with different weights")
        return True

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
        found = [(r.identity, r.seconds) for r in reversed(self.writer.records()) if r.step == step]
        claim = self.ledger.claim(step)  # published from another work folder, one since lost
        for identity, seconds in found + ([(claim.identity, 0.0)] if claim is not None else []):
            entry = self.ledger.get(identity)
            if entry is not None:
                return PublishedSnapshot(
                    identity=entry.identity, kind=entry.kind, base=entry.base, step=entry.step,
                    stored_bytes=entry.stored_bytes, raw_bytes=entry.raw_bytes, uploaded_bytes=0,
                    encode_seconds=seconds, upload_seconds=0.0,
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
            self._lock.release()
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
            e = self._error
            reason = describe_os_error(e) if isinstance(e, OSError) else str(e)
            raise PublishError(f"publishing failed: {reason}") from e

    # -- one checkpoint -------------------------------------------------------------------------

    def _base_checkpoint(self) -> Path | None:
        head = self.writer.head()
        if head is None:
            return None
        base = self.config.work_dir / f"base-{spool_name(head.step)}"
        return base if base.exists() else None

    def _publish_one(self, step: int, spooled: Path, *, restart: bool = False) -> PublishedSnapshot:
        self._check_settings()
        with publishing(self.store, self.config.run, self.config.work_dir):  # gc keeps off the run meanwhile
            # a head that gc retired from the store cannot be a delta's base: a full snapshot then
            restart = restart or base_retired(self.store, self.writer.head(), step)
            return self._publish_leased(step, spooled, restart=restart)

    def _publish_leased(self, step: int, spooled: Path, *, restart: bool) -> PublishedSnapshot:
        base = None if restart else self._base_checkpoint()
        with naming(self.writer.chain_dir):
            record = self.writer.add(spooled, base=base, step=step, restart=restart)
        crashpoint("after_encode")
        published = self._publish_record(record, spooled)
        promote_base(self.config.work_dir, step, spooled)
        crashpoint("after_promote")
        if self.config.retention and record.kind == "full":
            retire_old_chains(self.store, self.ledger)
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
        self._check_settings()
        with publishing(self.store, self.config.run, self.config.work_dir):  # gc keeps off the run meanwhile
            with naming(self.writer.chain_dir):
                record = self.writer.add(base, step=head.step, restart=True)
            published = self._publish_record(record, base, restart=True)
        self.published.append(published)
        return published

    def _publish_record(self, record: SnapshotRecord, checkpoint: Path, *, restart: bool = False) -> PublishedSnapshot:
        import time

        local = self.writer.chain_dir / record.identity
        t0 = time.perf_counter()
        entry = self.ledger.get(record.identity)
        uploaded = 0
        if entry is None:
            if not local.exists():
                raise PublishError(f"{local}: snapshot {record.identity} is neither on local disk nor in the store")
            head = self.writer.head()
            assert head is not None and head.identity == record.identity  # add() leaves its record at the head
            files, uploaded = upload_snapshot(self.store, local, record.identity)
            entry = LedgerEntry(
                identity=record.identity, kind=record.kind, base=record.base, step=record.step, run=self.config.run,
                files=files, raw_bytes=record.raw_bytes, stored_bytes=sum(f.size for f in files.values()),
                changed_tensors=record.changed_tensors, total_tensors=record.total_tensors, density=record.density,
                content=head_content(checkpoint, head.digests),
            )
            self.ledger.put(entry)
        crashpoint("after_ledger")
        self._claim(entry, restart=restart)
        crashpoint("after_claim")
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

    def _claim(self, entry: LedgerEntry, *, restart: bool) -> None:
        """Claim the step for ``entry``; another snapshot holding it is an error, unless ours is a full
        snapshot of the same weights (``publish_full``)."""
        content = entry.content if entry.content is not None else ""
        held = self.ledger.claim_step(StepClaim(step=entry.step, identity=entry.identity, content=content))
        if held.identity == entry.identity or (restart and held.content == content):
            return
        self.ledger.delete(entry.identity)  # the step keeps its one snapshot
        same = "the same" if held.content == content else "different"
        raise PublishError(f"step {entry.step} of run {self.config.run} was published meanwhile as {held.identity} "
                           f"({same} weights) by another publisher; {entry.identity} was withdrawn")


__all__ = ["PublishConfig", "PublishError", "PublishedSnapshot", "Publisher", "published_steps"]
