"""Every stored byte is checked: a flipped byte in any file of any snapshot, full or delta, is
refused by verify, apply and a load through the store, naming the snapshot and the file; a
corrupt download never stays in the cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from posttrain.chain import ChainError, ChecksumMismatch
from posttrain.chain.fetch import SnapshotSource
from posttrain.chain.manifest import MANIFEST_NAME
from posttrain.chain.ops import encode_snapshot, reconstruct, verify_chain
from posttrain.chain.safetensors_io import read_header
from posttrain.storage import LocalStore
from tests.support.tensors import load_bytes, perturb, random_tensor, save_torch_checkpoint

PREFIX = "runs/r1"
# full, delta, delta, full, delta; deltas change some tensors and inherit the others' bytes
KINDS = [("full-1", None), ("delta-2", "full-1"), ("delta-3", "delta-2"), ("full-4", None), ("delta-5", "full-4")]
LEAF = {"full-1": "delta-3", "delta-2": "delta-3", "delta-3": "delta-3", "full-4": "delta-5", "delta-5": "delta-5"}


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A folder store holding the five-snapshot chain (two shards per full snapshot), and each
    version's checkpoint."""
    root = tmp_path_factory.mktemp("corruption")
    rng = np.random.default_rng(7)
    state = {"a.w": random_tensor(rng, "BF16", (8, 16)), "a.b": random_tensor(rng, "F32", (16,)),
             "b.w": random_tensor(rng, "F16", (4, 8)), "c.i": random_tensor(rng, "I64", (5,))}
    chain = root / "store" / PREFIX
    ckpts: dict[str, Path] = {}
    prev = None
    for step, (identity, base) in enumerate(KINDS, 1):
        state = {n: perturb(rng, t, 0.2) if n.startswith("a.") else t for n, t in state.items()}
        ckpt = save_torch_checkpoint(root / f"ckpt-{step}", state)
        encode_snapshot(ckpt, chain, base_dir=prev if base else None, identity=identity,
                        base_identity=base, step=step, max_shard_bytes=300)
        ckpts[identity], prev = ckpt, ckpt
    assert len(list((chain / "full-1").glob("*.safetensors"))) >= 2
    return root / "store", ckpts


def flip(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def load_through_store(store_root: Path, identity: str, work: Path) -> Path:
    """What a hot-load does (serve/hotload_service.py): plan, fetch into a cache, view, rebuild."""
    source = SnapshotSource(LocalStore(store_root), PREFIX, work / "cache")
    plan = source.plan(identity, None)
    for name in plan.snapshots:
        source.fetch(name)
    view = source.view(plan, None, None, work / "view")
    return reconstruct(view, identity, work / "out").path


def named(err: BaseException, snapshot: str, fname: str) -> bool:
    msg = str(err)
    return f"snapshot {snapshot}" in msg and fname in msg and "\n" not in msg


def test_a_hundred_random_byte_flips_are_all_refused_by_name(stored, tmp_path):
    store_root, _ = stored
    chain = store_root / PREFIX
    files = {s: sorted(p.name for p in (chain / s).iterdir()) for s, _ in KINDS}
    assert all(MANIFEST_NAME in f for f in files.values())
    rng = np.random.default_rng(2024)
    for trial in range(100):
        snapshot = KINDS[rng.integers(len(KINDS))][0]
        fname = files[snapshot][rng.integers(len(files[snapshot]))]
        path = chain / snapshot / fname
        offset, mask = int(rng.integers(path.stat().st_size)), int(rng.integers(1, 256))
        where = f"trial {trial}: {snapshot}/{fname} byte {offset} ^ {mask:#04x}"
        flip(path, offset, mask)
        try:
            with pytest.raises(ChainError) as err:
                verify_chain(chain)
            assert named(err.value, snapshot, fname), f"{where}: {err.value}"
            for target in sorted({snapshot, LEAF[snapshot]}):
                out = tmp_path / f"out-{trial}-{target}"
                with pytest.raises(ChainError) as err:
                    reconstruct(chain, target, out)
                assert named(err.value, snapshot, fname), f"{where}, apply {target}: {err.value}"
                assert not out.exists()
            with pytest.raises(ChainError) as err:
                load_through_store(store_root, LEAF[snapshot], tmp_path / f"load-{trial}")
            assert named(err.value, snapshot, fname), f"{where}, load through the store: {err.value}"
            assert not (tmp_path / f"load-{trial}" / "cache" / snapshot).exists(), where
        finally:
            flip(path, offset, mask)
    assert len(verify_chain(chain)) == 2


def test_every_version_still_rebuilds_and_other_readers_ignore_the_checksums(stored, tmp_path):
    from safetensors import safe_open

    store_root, ckpts = stored
    for identity, _ in KINDS:
        out = load_through_store(store_root, identity, tmp_path / identity)
        assert load_bytes(out) == load_bytes(ckpts[identity])
        assert (out / MANIFEST_NAME).is_file()  # a rebuilt folder is checked too when it is the held one
        for shard in out.glob("*.safetensors"):
            with safe_open(str(shard), framework="numpy") as f:
                assert f.metadata() == {"format": "pt"}


def test_a_corrupt_rebuilt_folder_is_refused_as_the_held_version_and_by_encode(stored, tmp_path):
    chain, ckpts = stored[0] / PREFIX, stored[1]
    held = tmp_path / "held"
    reconstruct(chain, "delta-2", held)
    shard = sorted(held.glob("*.safetensors"))[0]
    info = next(iter(read_header(shard).tensors.values()))
    flip(shard, info.offset, 0x01)
    with pytest.raises(ChecksumMismatch) as err:
        reconstruct(chain, "delta-3", tmp_path / "next", held_dir=held)
    assert named(err.value, "held", shard.name) and repr(info.name) in str(err.value)
    for new, base in ((held, None), (ckpts["delta-3"], held)):  # nor is it encoded, as new weights or as a base
        with pytest.raises(ChecksumMismatch) as err:
            encode_snapshot(new, tmp_path / "other", base_dir=base, identity="x", base_identity="b")
        assert named(err.value, "held", shard.name)
    assert not (tmp_path / "other" / "x").exists()


def test_a_corrupt_download_is_not_cached_and_a_repaired_store_is_read_again(stored, tmp_path):
    store_root, ckpts = stored
    shard = sorted((store_root / PREFIX / "full-1").glob("*.safetensors"))[-1]
    info = next(iter(read_header(shard).tensors.values()))
    source = SnapshotSource(LocalStore(store_root), PREFIX, tmp_path / "cache")
    flip(shard, info.offset + 1, 0x10)
    try:
        with pytest.raises(ChecksumMismatch) as err:
            source.fetch("full-1")
        assert named(err.value, "full-1", shard.name) and f"{PREFIX}/full-1/{shard.name}" in str(err.value)
        assert not (tmp_path / "cache" / "full-1").exists()
    finally:
        flip(shard, info.offset + 1, 0x10)  # the store is repaired
    assert load_bytes(reconstruct(source.fetch("full-1").parent, "full-1", tmp_path / "v1").path) == load_bytes(
        ckpts["full-1"])

    # a cached copy damaged later: a broken header is seen on the next fetch and downloaded again...
    cached = tmp_path / "cache" / "full-1" / shard.name
    flip(cached, 3, 0x01)
    source.fetch("full-1")
    assert cached.read_bytes() == shard.read_bytes()
    # ...broken tensor bytes are seen when they are read; the hot-load then forgets the copy
    flip(cached, info.offset, 0x01)
    with pytest.raises(ChecksumMismatch):
        reconstruct(tmp_path / "cache", "full-1", tmp_path / "v1b")
    source.forget(["full-1"])
    reconstruct(source.fetch("full-1").parent, "full-1", tmp_path / "v1c")
    assert load_bytes(tmp_path / "v1c") == load_bytes(ckpts["full-1"])


def posttrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True)


def test_the_cli_refuses_in_one_line_and_its_cache_recovers_once_the_store_is_repaired(stored, tmp_path):
    store_root, ckpts = stored
    chain = store_root / PREFIX
    shard = sorted((chain / "full-1").glob("*.safetensors"))[0]
    info = next(iter(read_header(shard).tensors.values()))
    uri = f"file://{chain}"
    cache = tmp_path / "cache"
    flip(shard, info.offset, 0x80)
    try:
        for args in (["verify", str(chain)],
                     ["apply", str(chain), "--version", "delta-3", "--out", str(tmp_path / "o1")],
                     ["apply", uri, "--cache", str(cache), "--version", "delta-3", "--out", str(tmp_path / "o2")]):
            proc = posttrain("chain", *args)
            assert proc.returncode == 2, proc.stderr
            line = proc.stderr.strip()
            assert line.startswith("posttrain: error: snapshot full-1: file " + shard.name) and "\n" not in line
            assert "verified" not in proc.stdout and "OK" not in proc.stdout
    finally:
        flip(shard, info.offset, 0x80)
    ok = posttrain("chain", "apply", uri, "--cache", str(cache), "--version", "delta-3", "--out", str(tmp_path / "o3"))
    assert ok.returncode == 0, ok.stderr
    assert load_bytes(tmp_path / "o3") == load_bytes(ckpts["delta-3"])
    # a cached copy that went bad: the failed run drops it, the next one downloads it again
    cached = cache / "full-1" / shard.name
    flip(cached, info.offset, 0x80)
    bad = posttrain("chain", "apply", uri, "--cache", str(cache), "--version", "delta-3", "--out", str(tmp_path / "o4"))
    assert bad.returncode == 2 and "snapshot full-1: file " + shard.name in bad.stderr
    ok = posttrain("chain", "apply", uri, "--cache", str(cache), "--version", "delta-3", "--out", str(tmp_path / "o4"))
    assert ok.returncode == 0, ok.stderr
