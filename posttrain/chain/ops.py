"""Chain operations on folders: encode a snapshot, reconstruct a version, verify, inspect.

Every operation writes into a hidden temporary folder and renames it into place at the end, so
a failure leaves nothing behind and an existing folder is never overwritten.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.chain.apply import adopt_full, apply_chain, changed_bytes, write_checkpoint_index
from posttrain.chain.checkpoint import Checkpoint
from posttrain.chain.encode import (
    DEFAULT_MAX_SHARD_BYTES,
    EncodedSnapshot,
    Progress,
    write_delta,
    write_full,
    write_index,
)
from posttrain.chain.errors import ChainError, FormatError, MissingBase, OutputExists, WrongBase
from posttrain.chain.folder import ChainFolder, SnapshotRef
from posttrain.chain.format import (
    PROBE_NAME,
    Flavor,
    check_identity,
    make_identity,
    parse_slime_version,
    slime_dir,
)
from posttrain.chain.manifest import write_manifest
from posttrain.chain.snapshot import held_version, open_delta, read_index
from posttrain.fsutil import publish_dir, staging_dir

CHECKPOINT_STEP_RE = re.compile(r"checkpoint-(\d+)$")


def commit_dir(tmp: Path, final: Path) -> None:
    """Move a finished snapshot folder into place (``publish_dir``); ``OutputExists`` if it is there."""
    try:
        publish_dir(tmp, final)
    except FileExistsError as e:
        raise OutputExists(str(e)) from None


@dataclass
class SnapshotResult:
    identity: str
    kind: str
    base: str | None
    path: Path
    step: int
    raw_bytes: int
    stored_bytes: int
    changed_tensors: int
    total_tensors: int
    density: float
    seconds: float
    digests: dict[str, str] = field(repr=False, default_factory=dict)
    layout: dict[str, tuple[str, tuple[int, ...]]] = field(repr=False, default_factory=dict)

    @property
    def share_of_full(self) -> float:
        """A delta's stored bytes over the raw bytes of the weights; a full snapshot is the full
        (its index, config and checksums are not counted against it)."""
        if self.kind == "full":
            return 1.0
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 0.0

    @property
    def throughput(self) -> float:
        return self.raw_bytes / self.seconds if self.seconds > 0 else 0.0


class NoStep(ChainError):
    """A checkpoint folder whose step can be read neither from its name nor from trainer_state.json."""


def checkpoint_step(path: Path, default: int | None = None) -> int:
    """The training step of a checkpoint folder: ``checkpoint-<N>`` in its name, else ``global_step``
    of its ``trainer_state.json``, else ``default``; ``NoStep`` when there is none and no default
    (never a silent 0)."""
    m = CHECKPOINT_STEP_RE.search(path.name)
    if m:
        return int(m.group(1))
    state = path / "trainer_state.json"
    if state.is_file():
        try:
            step = json.loads(state.read_text()).get("global_step")
        except (ValueError, AttributeError):
            raise NoStep(f"{state}: not a JSON object with global_step") from None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
        raise NoStep(f"{state}: global_step is {step!r}, not a step number")
    if default is not None:
        return default
    raise NoStep(f"{path}: no step in the folder's name (checkpoint-<N>) and no trainer_state.json; "
                 "give the step (--step)")


def encode_snapshot(
    new_dir: str | Path,
    chain_dir: str | Path,
    *,
    base_dir: str | Path | None = None,
    flavor: Flavor | str = Flavor.COREWEAVE,
    identity: str | None = None,
    base_identity: str | None = None,
    step: int | None = None,
    run: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    workers: int | None = None,
    progress: Progress | None = None,
    expected_base: dict[str, str] | None = None,
    durable: bool = True,
) -> SnapshotResult:
    """Write a full snapshot of ``new_dir`` (no base) or a delta against ``base_dir`` into the chain."""
    t0 = time.perf_counter()
    flavor = Flavor(flavor)
    chain_dir = Path(chain_dir)
    if max_shard_bytes <= 0:
        raise ChainError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if identity is not None and flavor is Flavor.COREWEAVE:
        check_identity(identity)
    if base_identity is not None and flavor is Flavor.COREWEAVE:
        check_identity(base_identity, "base identity")
    new = Checkpoint.open(new_dir)
    base = Checkpoint.open(base_dir) if base_dir is not None else None
    chain_dir.mkdir(parents=True, exist_ok=True)
    existing = ChainFolder(chain_dir).ordered()
    step = checkpoint_step(Path(new_dir), default=0) if step is None else step
    run = run if run is not None else chain_dir.resolve().name
    kind = "full" if base is None else "delta"

    if flavor is Flavor.SLIME:
        version, base_version = _slime_versions(existing, identity, base_identity, kind)
        name = slime_dir(version)
        version_label, base_label = f"{version:06d}", (f"{base_version:06d}" if base is not None else None)
    else:
        base_label = None
        if base is not None:
            base_label = base_identity or held_version(base) or (existing[-1].name if existing else None)
            if base_label is None:
                raise ChainError("name the base snapshot's identity with --base-identity (the chain folder is empty)")
            check_identity(base_label, "base identity")
        name = version_label = identity or ""
    if name and (chain_dir / name).exists():
        raise OutputExists(f"{chain_dir / name} already exists; nothing was overwritten")

    with staging_dir(chain_dir / (name or "snapshot")) as tmp:
        if base is None:
            enc = write_full(new, tmp, flavor=flavor, max_shard_bytes=max_shard_bytes, workers=workers,
                             progress=progress, durable=durable)
        else:
            enc = write_delta(new, base, tmp, flavor=flavor, max_shard_bytes=max_shard_bytes, workers=workers,
                              progress=progress, expected_base=expected_base, durable=durable)
        if (new.path / PROBE_NAME).is_file():  # full and delta snapshots carry the probe
            from posttrain.chain.probe import copy_probe  # pydantic: only for a checkpoint with a probe

            enc.extra_files.update(copy_probe(new.path, tmp))
        if not name:
            name = version_label = make_identity(run=run, step=step, kind=kind, base_identity=base_label,
                                                 content=enc.content)
        write_index(tmp, enc, version=version_label, base_version=base_label)
        write_manifest(tmp, enc.digests() if enc.kind == "full" else None)
        commit_dir(tmp, chain_dir / name)
    return _result(name, enc, base_label, chain_dir / name, step, time.perf_counter() - t0)


def _slime_versions(existing: list[SnapshotRef], identity: str | None, base_identity: str | None,
                    kind: str) -> tuple[int, int]:
    have = [parse_slime_version(r.name) for r in existing if r.flavor is Flavor.SLIME]
    version = parse_slime_version(identity) if identity is not None else (max(have) + 1 if have else 1)
    if version < 1:
        raise FormatError("slime version 0 is the engine's boot weights; the first published version is 1")
    base_version = parse_slime_version(base_identity) if base_identity is not None else version - 1
    if kind == "delta" and base_version != version - 1:
        raise FormatError(f"slime versions are contiguous: version {version} must build on {version - 1}, "
                          f"not {base_version}")
    return version, base_version


def _result(name: str, enc: EncodedSnapshot, base: str | None, path: Path, step: int, secs: float) -> SnapshotResult:
    return SnapshotResult(
        identity=name,
        kind=enc.kind,
        base=base,
        path=path,
        step=step,
        raw_bytes=enc.raw_bytes,
        stored_bytes=enc.stored_bytes,
        changed_tensors=enc.changed_tensors,
        total_tensors=len(enc.tensors),
        density=enc.density,
        seconds=secs,
        digests=enc.digests(),
        layout=enc.layout,
    )


@dataclass
class Reconstructed:
    version: str
    path: Path | None
    start: str  # the full snapshot, held checkpoint or boot weights it started from
    deltas: list[str]
    bytes: int
    seconds: float
    digests: dict[str, str] = field(repr=False, default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def reconstruct(
    chain_dir: str | Path,
    version: str,
    out_dir: str | Path | None,
    *,
    held_dir: str | Path | None = None,
    boot_dir: str | Path | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    durable: bool = True,
    take_full: bool = False,
) -> Reconstructed:
    """Rebuild ``version`` into a Hugging Face checkpoint at ``out_dir`` (None: verify only).

    ``take_full``: when ``version`` is a full snapshot (no delta to apply), move its shard files
    into ``out_dir`` after checking them instead of copying them; the chain folder loses them (for
    a caller that drops its copy of the snapshot afterwards).

    ``held_dir`` is a checkpoint that already holds a version on the path (its index records
    it): only the deltas after it are applied, and a delta whose base is not that version is
    refused. The chain folder then needs only those deltas, not the held version's snapshot.
    """
    t0 = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and out.exists():
        raise OutputExists(f"{out} already exists; nothing was overwritten")
    chain = ChainFolder(chain_dir)
    target = chain.find(version)
    held_ckpt = Checkpoint.open(held_dir) if held_dir is not None else None
    held = held_version(held_ckpt) if held_ckpt is not None else None
    if held_ckpt is not None and held is None:
        raise WrongBase(f"{held_dir} records no version it holds (metadata.version in its index)")
    try:
        full, delta_refs = chain.resolve(target.name, held=held)
    except MissingBase as e:
        if held is None:
            raise
        raise WrongBase(f"{e.snapshot} builds on {e.base}, which neither {chain.path} holds nor {held_dir} (it "
                        f"holds {held}): the chain lacks a delta between {held} and {target.name}, or {held_dir} "
                        f"holds a version not on its path") from None
    if full is not None:
        start_ckpt, start = Checkpoint.open(full.path), full.name
        if held is not None:
            raise WrongBase(f"{held_dir} holds {held}, which is not on the path to {target.name} "
                            f"(it builds on full snapshot {full.name})")
    elif held_ckpt is not None:
        start_ckpt, start = held_ckpt, f"{held} (held by {held_dir})"
    elif boot_dir is not None:
        start_ckpt, start = Checkpoint.open(boot_dir), f"boot weights {boot_dir}"
    else:
        raise ChainError(f"{target.name} builds on slime's version 0 (the engine's boot weights): "
                         "pass the boot checkpoint (--boot DIR)")
    deltas = chain.open_deltas(delta_refs)
    if deltas and held is not None and deltas[0].base_version != held:
        raise WrongBase(f"delta {deltas[0].version} is against {deltas[0].base_version}, but {held_dir} holds {held}")
    config = _config_of(full.path if full else None, start_ckpt)
    if out is None:
        applied = apply_chain(start_ckpt, deltas, None, workers=workers, progress=progress)
    else:
        with staging_dir(out) as tmp:
            if take_full and full is not None and not deltas:
                applied = adopt_full(start_ckpt, tmp, workers=workers, progress=progress, durable=durable)
            else:
                applied = apply_chain(start_ckpt, deltas, tmp, workers=workers, progress=progress, durable=durable)
            write_checkpoint_index(tmp, start_ckpt, target.version, config)
            if (target.path / PROBE_NAME).is_file():
                from posttrain.chain.probe import copy_target_probe

                copy_target_probe(target.path, tmp)
            write_manifest(tmp, applied.version_digests)
            commit_dir(tmp, out)
    return Reconstructed(target.version, out, start, [d.version for d in deltas], applied.bytes,
                         time.perf_counter() - t0, applied.version_digests)


def _config_of(full_path: Path | None, start: Checkpoint) -> bytes | None:
    if full_path is not None and (full_path / "config.json").is_file():
        return (full_path / "config.json").read_bytes()
    return start.config_bytes()


@dataclass
class VerifiedPath:
    leaf: str
    start: str | None
    deltas: list[str]
    bytes: int


def verify_chain(chain_dir: str | Path, *, boot_dir: str | Path | None = None, workers: int | None = None,
                 progress: Progress | None = None) -> list[VerifiedPath]:
    """Check every snapshot: headers, indexes, base links, and every delta's checksums in order."""
    chain = ChainFolder(chain_dir)
    out = []
    for leaf in chain.leaves():
        full, refs = chain.resolve(leaf.name)
        if full is None and boot_dir is None:
            raise ChainError(f"{leaf.name} builds on slime's boot weights: pass --boot DIR to verify it")
        start = Checkpoint.open(full.path if full else boot_dir)
        deltas = chain.open_deltas(refs)
        applied = apply_chain(start, deltas, None, workers=workers, progress=progress)
        out.append(VerifiedPath(leaf.name, full.name if full else None, [d.version for d in deltas], applied.bytes))
    return out


@dataclass
class SnapshotSummary:
    name: str
    kind: str
    base: str | None
    changed_tensors: int
    total_tensors: int
    stored_bytes: int
    full_bytes: int  # raw bytes of the model version
    density: float | None = None
    # Stored bytes of the full snapshot this version builds on (itself, for a full one); 0 when the
    # chain holds none (a slime chain on boot weights).
    full_stored_bytes: int = 0

    @property
    def share_of_full(self) -> float | None:
        """Stored bytes over those of the full snapshot the version builds on: what fetching this
        snapshot costs against fetching a full one. A full snapshot is 1.0; None without one."""
        return self.stored_bytes / self.full_stored_bytes if self.full_stored_bytes else None


def inspect_chain(chain_dir: str | Path, *, density: bool = False) -> list[SnapshotSummary]:
    """One summary per snapshot; ``density`` decompresses deltas to count the bytes that changed."""
    chain = ChainFolder(chain_dir)
    out = []
    for ref in chain.ordered():
        stored = _stored_bytes(ref)
        if ref.kind == "full":
            ckpt = Checkpoint.open(ref.path)
            n = len(ckpt.tensors)
            out.append(SnapshotSummary(ref.name, "full", None, n, n, stored, ckpt.total_bytes, 1.0, stored))
        else:
            full, _ = chain.resolve(ref.name)
            total, n = _full_size(full)
            changed = len(read_index(ref.path).get("weight_map", {}))
            dens = changed_bytes(open_delta(ref.path)) / total if density and total else None
            out.append(SnapshotSummary(ref.name, "delta", ref.base_version, changed, n, stored, total, dens,
                                       _stored_bytes(full) if full is not None else 0))
    return out


def _stored_bytes(ref: SnapshotRef) -> int:
    return sum(p.stat().st_size for p in ref.path.iterdir() if p.is_file())


def _full_size(full: SnapshotRef | None) -> tuple[int, int]:
    if full is None:
        return 0, 0
    ckpt = Checkpoint.open(full.path)
    return ckpt.total_bytes, len(ckpt.tensors)
