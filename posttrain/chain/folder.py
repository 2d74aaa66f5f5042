"""A chain in a folder: snapshots as sub-folders, resolved by their base links."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from posttrain.chain.checkpoint import INDEX_NAME, Checkpoint
from posttrain.chain.errors import FormatError, MissingBase, WrongBase
from posttrain.chain.format import SLIME_DIR_RE, Flavor, parse_slime_version, slime_dir
from posttrain.chain.snapshot import DeltaSnapshot, is_delta_index, open_delta, read_index

STEP_RE = re.compile(r"^step-(\d+)-")


@dataclass(frozen=True)
class SnapshotRef:
    name: str  # folder name: the identity, or weight_vNNNNNN
    path: Path
    kind: str  # "full" or "delta"
    version: str  # the version as deltas name it (identity, or six digits for slime)
    base_version: str | None

    @property
    def flavor(self) -> Flavor:
        return Flavor.SLIME if SLIME_DIR_RE.fullmatch(self.name) else Flavor.COREWEAVE


def _sort_key(ref: SnapshotRef) -> tuple:
    m = SLIME_DIR_RE.fullmatch(ref.name) or STEP_RE.match(ref.name)
    return (int(m.group(1)) if m else -1, ref.name)


class ChainFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FormatError(f"{self.path}: chain folder does not exist")
        self._refs: dict[str, SnapshotRef] | None = None

    def refs(self) -> dict[str, SnapshotRef]:
        """Committed snapshots (folders with an index); temporary and hidden folders are skipped."""
        if self._refs is None:
            refs = {}
            for p in sorted(self.path.iterdir()):
                if p.name.startswith(".") or not (p / INDEX_NAME).is_file():
                    continue
                index = read_index(p)
                slime = SLIME_DIR_RE.fullmatch(p.name)
                if is_delta_index(index):
                    meta = index["metadata"]
                    version, base = str(meta.get("version")), str(meta.get("base_version"))
                    expected = slime.group(1) if slime else p.name
                    if version != expected:
                        raise FormatError(f"{p / INDEX_NAME}: metadata.version {version!r} does not match its folder")
                    refs[p.name] = SnapshotRef(p.name, p, "delta", version, base)
                else:
                    refs[p.name] = SnapshotRef(p.name, p, "full", slime.group(1) if slime else p.name, None)
            self._refs = dict(sorted(refs.items(), key=lambda kv: _sort_key(kv[1])))
        return self._refs

    def ordered(self) -> list[SnapshotRef]:
        return list(self.refs().values())

    def find(self, version: str) -> SnapshotRef:
        refs = self.refs()
        if version in refs:
            return refs[version]
        if version.isdigit() or SLIME_DIR_RE.fullmatch(version):
            name = slime_dir(parse_slime_version(version))
            if name in refs:
                return refs[name]
        raise FormatError(f"{self.path}: no snapshot {version!r} (have: {', '.join(refs) or 'none'})")

    def _base_of(self, ref: SnapshotRef) -> SnapshotRef | None:
        """The snapshot a delta builds on; None when it builds on slime's boot weights (version 0)."""
        assert ref.base_version is not None
        if ref.flavor is Flavor.SLIME:
            n = parse_slime_version(ref.base_version)
            if n != parse_slime_version(ref.version) - 1:
                raise FormatError(f"{ref.path}: slime delta {ref.version} has base {ref.base_version}, not N-1")
            name = slime_dir(n)
            if name not in self.refs() and n == 0:
                return None
        else:
            name = ref.base_version
        base = self.refs().get(name)
        if base is None:
            raise MissingBase(f"{ref.path}: its base {ref.base_version!r} is not in {self.path}", ref.name,
                              ref.base_version)
        return base

    def resolve(self, target: str, *, held: str | None = None) -> tuple[SnapshotRef | None, list[SnapshotRef]]:
        """The full snapshot (None: boot weights or ``held``) and the deltas that lead to ``target``.

        With ``held``, the walk stops at that version when it is on the path, so a consumer holding
        it applies only the deltas after it; the chain then need not hold that version's own snapshot.
        """
        ref = self.find(target)
        deltas: list[SnapshotRef] = []
        seen = set()
        while ref.kind == "delta":
            if held is not None and ref.version == held:
                return None, list(reversed(deltas))
            if ref.name in seen:
                raise FormatError(f"{self.path}: base links loop at {ref.name}")
            seen.add(ref.name)
            deltas.append(ref)
            try:
                base = self._base_of(ref)
            except MissingBase:
                if held is not None and ref.base_version == held:  # the held folder is that base
                    return None, list(reversed(deltas))
                raise
            if base is None:
                if held is not None and parse_slime_version(held) == 0:
                    return None, list(reversed(deltas))
                return None, list(reversed(deltas))
            ref = base
        if held is not None and ref.version == held:
            return None, list(reversed(deltas))
        return ref, list(reversed(deltas))

    def open_deltas(self, refs: list[SnapshotRef]) -> list[DeltaSnapshot]:
        out = []
        for r in refs:
            d = open_delta(r.path)
            out.append(d)
        return out

    def leaves(self) -> list[SnapshotRef]:
        """Snapshots no delta builds on: verifying each one's path covers the whole chain."""
        bases = set()
        for r in self.refs().values():
            if r.kind == "delta":
                b = self._base_of(r)
                if b is not None:
                    bases.add(b.name)
        return [r for r in self.refs().values() if r.name not in bases]


def check_holds(ckpt: Checkpoint, version: str, held: str | None, what: Path) -> None:
    if held is None:
        raise WrongBase(f"{what} records no version it holds; cannot apply deltas against {version} to it")
    if held != version:
        raise WrongBase(f"the delta is against {version}, but {what} holds {held}")
