"""Fetching the snapshots a version needs from a store into a local cache, and rebuilding it.

The store holds ``<prefix>/<identity>/<file>``; a snapshot exists once its index (the commit
marker) does. Every file is checked against the snapshot's checksums file
(``posttrain.chain.manifest``) before the snapshot enters the cache, so a corrupt download is
never kept, and an index is checked before its base link is followed. From the requested identity the ``base_version`` links are followed back to a
full snapshot, or to the version the server holds, whichever comes first; only those
snapshots are downloaded. A per-operation *view* folder then holds links to them (and to the
held checkpoint, under its version's name) so ``posttrain.chain.ops.reconstruct`` sees a chain
folder with exactly that path.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.errors import ChainError
from posttrain.chain.format import IDENTITY_RE, MAX_CHAIN_DELTAS
from posttrain.chain.manifest import MANIFEST_NAME, Manifest, load_manifest, parse_manifest
from posttrain.chain.ops import Reconstructed, reconstruct
from posttrain.fsutil import publish_dir, staging_dir
from posttrain.storage.base import Store
from posttrain.storage.errors import NotFound
from posttrain.storage.keys import join


class SnapshotError(ChainError):
    """A snapshot is missing from the store, malformed, or its chain cannot be resolved."""


@dataclass(frozen=True)
class ChainPlan:
    target: str
    target_kind: str  # "full" or "delta"
    target_base: str | None  # base_version of a delta target
    start: str  # "full": snapshots[0] is a full snapshot; "held": the deltas apply to the held version
    snapshots: list[str]  # oldest first; empty when the held version is the target


class SnapshotSource:
    def __init__(self, store: Store, prefix: str, cache_dir: Path):
        self.store = store
        self.prefix = prefix.strip("/")
        self.cache_dir = cache_dir
        cache_dir.mkdir(parents=True, exist_ok=True)

    def _key(self, identity: str, name: str = "") -> str:
        return join(self.prefix, f"{identity}/{name}" if name else f"{identity}/")

    def _origin(self, identity: str) -> str:
        return f"{self.store.uri.rstrip('/')}/{self._key(identity)}".rstrip("/")

    def _manifest(self, identity: str) -> Manifest | None:
        """The snapshot's checksums file in the store, self-checked; None when it has none."""
        try:
            raw, _ = self.store.get_bytes(self._key(identity, MANIFEST_NAME))
        except NotFound:
            return None
        return parse_manifest(raw, self.cache_dir / identity, f"snapshot {identity}", self._origin(identity))

    def index(self, identity: str) -> dict:
        """The snapshot's index in the store, checked against its checksums file when it has one."""
        try:
            data, _ = self.store.get_bytes(self._key(identity, INDEX_NAME))
        except NotFound:
            raise SnapshotError(f"snapshot {identity} is not in the store ({self.store.uri}, prefix "
                                f"{self.prefix or '(none)'}): no {INDEX_NAME}") from None
        manifest = self._manifest(identity)
        if manifest is not None:
            manifest.check_bytes(INDEX_NAME, data)
        try:
            index = json.loads(data)
        except ValueError:
            raise SnapshotError(f"snapshot {identity}: {INDEX_NAME} is not JSON") from None
        if not isinstance(index, dict):
            raise SnapshotError(f"snapshot {identity}: {INDEX_NAME} is not a JSON object")
        return index

    def describe(self, identity: str) -> tuple[str, str | None]:
        """("full", None) or ("delta", base_version) of a snapshot in the store."""
        meta = self.index(identity).get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        if "delta_encoding" in meta:
            return "delta", meta.get("base_version")
        return "full", None

    def plan(self, identity: str, held: str | None) -> ChainPlan:
        """The snapshots to apply to reach ``identity``, starting from ``held`` when it is on the path."""
        chain: list[str] = []
        kind, base = "full", None
        cur = identity
        while True:
            if cur == held:
                return ChainPlan(identity, kind, base, "held", list(reversed(chain)))
            meta = self.index(cur).get("metadata")
            meta = meta if isinstance(meta, dict) else {}
            is_delta = "delta_encoding" in meta
            if cur == identity:
                kind = "delta" if is_delta else "full"
                base = meta.get("base_version") if is_delta else None
            chain.append(cur)
            if not is_delta:
                return ChainPlan(identity, kind, base, "full", list(reversed(chain)))
            nxt = meta.get("base_version")
            if not isinstance(nxt, str) or not IDENTITY_RE.fullmatch(nxt):
                raise SnapshotError(f"delta snapshot {cur} names no valid base_version ({nxt!r})")
            if nxt in chain:
                raise SnapshotError(f"the base links of {identity} loop at {nxt}")
            if len(chain) > MAX_CHAIN_DELTAS:
                raise SnapshotError(f"{identity} is more than {MAX_CHAIN_DELTAS} deltas after a full snapshot "
                                    "or the version served (publish a full snapshot)")
            cur = nxt

    def fetch(self, identity: str) -> Path:
        """The snapshot's folder in the cache, downloaded (index last) unless it is there already.

        A download is checked against the snapshot's checksums file, every byte, before it enters
        the cache; a cached copy whose files or headers no longer match is downloaded again."""
        dest = self.cache_dir / identity
        if (dest / INDEX_NAME).is_file():
            try:
                cached = load_manifest(dest, f"snapshot {identity}")
                if cached is not None:
                    cached.check_all()
                    return dest
                if not (self.store.exists(self._key(identity, MANIFEST_NAME))):
                    return dest  # a snapshot without checksums (another producer's): kept as it is
            except ChainError:
                pass  # damaged since it was downloaded: download it again
        prefix = self._key(identity)
        names = [k[len(prefix):] for k in self.store.list(prefix)]
        names = [n for n in names if n and "/" not in n]
        if INDEX_NAME not in names:
            raise SnapshotError(f"snapshot {identity} is not in the store: no {INDEX_NAME}")
        if dest.exists():
            shutil.rmtree(dest)  # a partial copy left by a crash
        try:
            with staging_dir(dest) as tmp:
                for name in sorted(names, key=lambda n: n == INDEX_NAME):  # the index last
                    self.store.get_file(self._key(identity, name), tmp / name)
                manifest = load_manifest(tmp, f"snapshot {identity}", self._origin(identity))
                if manifest is not None:
                    manifest.check_all(deep=True)
                    manifest.check(INDEX_NAME)  # refused when it is not listed
                publish_dir(tmp, dest)
        except NotFound as e:
            raise SnapshotError(f"snapshot {identity}: a file vanished while downloading ({e})") from None
        except FileExistsError:
            if not (dest / INDEX_NAME).is_file():  # else another fetcher of the same snapshot won the race
                raise
        return dest

    def forget(self, identities: list[str]) -> None:
        """Drop cached copies (after a failed load, so a repaired store is read again)."""
        for identity in identities:
            shutil.rmtree(self.cache_dir / identity, ignore_errors=True)

    def view(self, plan: ChainPlan, held: str | None, held_dir: Path | None, dest: Path) -> Path:
        """A chain folder of links: the plan's snapshots, plus the held checkpoint named by its version."""
        dest.mkdir(parents=True)
        for identity in plan.snapshots:
            (dest / identity).symlink_to(self.fetch(identity).resolve(), target_is_directory=True)
        if plan.start == "held":
            assert held is not None and held_dir is not None
            (dest / held).symlink_to(held_dir.resolve(), target_is_directory=True)
        return dest


def reconstruct_from_store(store: Store, identity: str, out_dir: Path, *, cache_dir: Path) -> Reconstructed:
    """Download (into ``cache_dir``) the full snapshot and deltas ``identity`` needs; rebuild it at ``out_dir``."""
    source = SnapshotSource(store, "", cache_dir)
    for name in source.plan(identity, held=None).snapshots:
        source.fetch(name)
    return reconstruct(cache_dir, identity, out_dir)
