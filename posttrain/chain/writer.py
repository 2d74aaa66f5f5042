"""A chain producer: feeds checkpoints in step order into a chain folder under the chain policy.

Its memory is ``<chain>/.posttrain/head.json`` (and one record per snapshot), so a restarted
producer continues the chain, and redoing a step that was already written returns the same
snapshot instead of writing another.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from posttrain.chain.checkpoint import Checkpoint
from posttrain.chain.encode import DEFAULT_MAX_SHARD_BYTES, write_json_atomic
from posttrain.chain.errors import OutputExists, WrongBase
from posttrain.chain.format import Flavor, parse_slime_version, slime_dir
from posttrain.chain.ops import SnapshotResult, checkpoint_step, commit_dir, encode_snapshot
from posttrain.chain.policy import ChainHead, ChainPolicy, Decision, layout_digest, over_budget, plan

STATE_DIR = ".posttrain"


class SnapshotRecord(BaseModel):
    """One snapshot as the producer wrote it."""

    model_config = ConfigDict(extra="forbid")

    identity: str = Field(description="Folder name (identity or weight_vNNNNNN).")
    kind: str = Field(description="full or delta.")
    base: str | None = Field(description="Version the delta builds on.")
    step: int = Field(description="Training step.")
    reason: str = Field(description="Why the policy chose this kind.")
    raw_bytes: int = Field(description="Bytes of the model version.")
    stored_bytes: int = Field(description="Bytes of the snapshot's shards.")
    changed_tensors: int = Field(description="Tensors stored (all, for a full snapshot).")
    total_tensors: int = Field(description="Tensors of the model.")
    density: float = Field(description="Share of the model's bytes that changed.")
    seconds: float = Field(description="Encoding wall time.")


class ChainWriter:
    def __init__(
        self,
        chain_dir: str | Path,
        *,
        flavor: Flavor | str = Flavor.COREWEAVE,
        run: str | None = None,
        policy: ChainPolicy | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        workers: int | None = None,
    ):
        self.chain_dir = Path(chain_dir)
        self.flavor = Flavor(flavor)
        self.run = run
        self.policy = policy or ChainPolicy()
        self.max_shard_bytes = max_shard_bytes
        self.workers = workers
        self.state_dir = self.chain_dir / STATE_DIR
        self.staging = self.state_dir / "staging"

    def head(self) -> ChainHead | None:
        path = self.state_dir / "head.json"
        return ChainHead.model_validate_json(path.read_text()) if path.exists() else None

    def record(self, identity: str) -> SnapshotRecord | None:
        path = self.state_dir / "records" / f"{identity}.json"
        return SnapshotRecord.model_validate_json(path.read_text()) if path.exists() else None

    def records(self) -> list[SnapshotRecord]:
        """Every snapshot written, in the order written."""
        folder = self.state_dir / "records"
        paths = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns) if folder.exists() else []
        found = [SnapshotRecord.model_validate_json(p.read_text()) for p in paths]
        return sorted(found, key=lambda r: r.step)  # stable: same-step records keep their order

    def add(
        self,
        checkpoint: str | Path,
        *,
        base: str | Path | None = None,
        step: int | None = None,
        restart: bool = False,
        progress=None,
    ) -> SnapshotRecord:
        """Write ``checkpoint`` as the chain's next snapshot; ``base`` holds the head's weights."""
        checkpoint = Path(checkpoint)
        step = checkpoint_step(checkpoint, default=0) if step is None else step
        head = self.head()
        new = Checkpoint.open(checkpoint)
        layout = layout_digest(new.layout())
        if head is not None and head.step == step and not restart:
            done = self.record(head.identity)
            if done is not None and head.digests.keys() == new.tensors.keys():
                return done  # this step is the head already: a retry, nothing to write
        decision = plan(self.policy, head, layout=layout, has_base=base is not None, restart=restart)
        result = None
        if decision.kind == "delta":
            assert head is not None and base is not None
            try:
                result = self._encode(checkpoint, base, head, step, progress)
            except WrongBase:
                decision = Decision("full", "the base checkpoint's bytes differ from the chain head")
            else:
                if over_budget(self.policy, head, result.stored_bytes):
                    shutil.rmtree(result.path)
                    result = None
                    decision = Decision("full", "this delta would take the bytes since the last full "
                                                "snapshot past the budget")
        if result is None:
            result = self._encode(checkpoint, None, head, step, progress)
        final = self._commit(result)
        record = SnapshotRecord(
            identity=final.name, kind=result.kind, base=result.base, step=step, reason=decision.reason,
            raw_bytes=result.raw_bytes, stored_bytes=result.stored_bytes, changed_tensors=result.changed_tensors,
            total_tensors=result.total_tensors, density=result.density, seconds=result.seconds,
        )
        self._advance(head, record, result, layout)
        return record

    def _encode(self, checkpoint: Path, base: Path | None, head: ChainHead | None, step: int,
                progress) -> SnapshotResult:
        identity = None
        if self.flavor is Flavor.SLIME:
            identity = slime_dir(parse_slime_version(head.version) + 1 if head else 1)
        if self.staging.exists():
            shutil.rmtree(self.staging)  # leftovers of a crash: never committed
        return encode_snapshot(
            checkpoint, self.staging, base_dir=base, flavor=self.flavor, identity=identity,
            base_identity=head.version if base is not None and head else None, step=step,
            run=self.run or self.chain_dir.resolve().name, max_shard_bytes=self.max_shard_bytes,
            workers=self.workers, progress=progress, expected_base=head.digests if base is not None and head else None,
        )

    def _commit(self, result: SnapshotResult) -> Path:
        final = self.chain_dir / result.identity
        try:
            commit_dir(result.path, final)
        except OutputExists:
            shutil.rmtree(result.path)  # written before by a run that stopped before recording it
        shutil.rmtree(self.staging, ignore_errors=True)
        result.path = final
        return final

    def _advance(self, head: ChainHead | None, record: SnapshotRecord, result: SnapshotResult, layout: str) -> None:
        version = record.identity
        if self.flavor is Flavor.SLIME:
            version = f"{parse_slime_version(record.identity):06d}"
        if record.kind == "full":
            full_identity, full_bytes, n, nbytes = record.identity, record.stored_bytes, 0, 0
        else:
            assert head is not None
            full_identity, full_bytes = head.full_identity, head.full_bytes
            n, nbytes = head.deltas_since_full + 1, head.delta_bytes_since_full + record.stored_bytes
        new_head = ChainHead(
            identity=record.identity, version=version, step=record.step, full_identity=full_identity,
            full_bytes=full_bytes, deltas_since_full=n, delta_bytes_since_full=nbytes, layout_digest=layout,
            digests=result.digests,
        )
        (self.state_dir / "records").mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.state_dir / "records" / f"{record.identity}.json", record.model_dump())
        write_json_atomic(self.state_dir / "head.json", new_head.model_dump())
