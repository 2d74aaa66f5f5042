"""Round trips: full and delta snapshots reconstruct every tensor bit-exact, in both flavours."""

from __future__ import annotations

import json
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from posttrain.chain.ops import encode_snapshot, inspect_chain, reconstruct, verify_chain
from tests.support.tensors import TORCH_DTYPES, load_bytes, perturb, random_tensor, save_torch_checkpoint


def test_full_then_delta_reconstructs_bit_exact(model_pair, tmp_path):
    base, new = model_pair
    chain = tmp_path / "chain"
    full = encode_snapshot(base, chain, step=6)
    delta = encode_snapshot(new, chain, base_dir=base)
    assert delta.base == full.identity
    assert delta.identity.startswith("step-00000007-")  # step taken from checkpoint-7
    index = json.loads((delta.path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {
        "version": delta.identity, "base_version": full.identity, "delta_encoding": "xor",
        "compression_format": "zstd", "checksum_format": "adler32",
    }
    assert "positions" not in index["weight_map"]  # unchanged tensors are left out
    assert "empty" not in index["weight_map"]
    # the format's files, and posttrain's checksums of every one (other readers ignore that file)
    assert sorted(p.name for p in delta.path.iterdir()) == [
        "model-00000.safetensors", "model.safetensors.index.json", "posttrain.checksums.json"]
    assert sorted(p.name for p in full.path.iterdir()) == [
        "config.json", "model-00000.safetensors", "model.safetensors.index.json", "posttrain.checksums.json"]

    rows = inspect_chain(chain, density=True)
    assert [r.kind for r in rows] == ["full", "delta"]
    assert rows[1].density == pytest.approx(delta.density) and 0 < delta.density < 0.2

    out = tmp_path / "rebuilt"
    reconstruct(chain, delta.identity, out)
    assert load_bytes(out) == load_bytes(new)
    rebuilt_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert rebuilt_index["metadata"]["version"] == delta.identity
    reconstruct(chain, full.identity, tmp_path / "rebuilt-full")
    assert load_bytes(tmp_path / "rebuilt-full") == load_bytes(base)


@pytest.mark.parametrize("flavor", ["coreweave", "slime"])
def test_delta_frames_are_xor_and_checksums_are_the_specs(model_pair, tmp_path, flavor):
    base, new = model_pair
    chain = tmp_path / "chain"
    encode_snapshot(base, chain, flavor=flavor)
    delta = encode_snapshot(new, chain, base_dir=base, flavor=flavor)
    old_t, new_t = load_bytes(base), load_bytes(new)
    index = json.loads((delta.path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["checksum_format"] == ("adler32" if flavor == "coreweave" else "xxh3-128")
    seen = set()
    for fname in set(index["weight_map"].values()):
        with safe_open(str(delta.path / fname), framework="numpy") as f:
            meta = f.metadata()
            for name in f.keys():
                frame = f.get_tensor(name)
                assert frame.dtype == np.uint8 and frame.ndim == 1
                # one frame, content size in its header
                params = zstandard.get_frame_parameters(frame.tobytes())
                assert params.content_size == len(new_t[name][2])
                xor = zstandard.ZstdDecompressor().decompress(frame.tobytes())
                expected = np.bitwise_xor(np.frombuffer(new_t[name][2], np.uint8), np.frombuffer(old_t[name][2], np.uint8))
                assert xor == expected.tobytes()
                if flavor == "coreweave":
                    assert meta[name] == "%08x" % zlib.adler32(new_t[name][2])
                else:
                    assert meta[name] == xxhash.xxh3_128_hexdigest(new_t[name][2])
                seen.add(name)
    changed = {n for n in new_t if new_t[n][2] != old_t[n][2]}
    assert seen == changed


def test_slime_layout_versions_and_boot_weights(model_pair, tmp_path):
    base, new = model_pair
    chain = tmp_path / "disk"
    # version 1 is a delta against the engine's boot weights (version 0, never stored)
    v1 = encode_snapshot(new, chain, base_dir=base, flavor="slime")
    assert v1.identity == "weight_v000001" and v1.base == "000000"
    v2 = encode_snapshot(base, chain, base_dir=new, flavor="slime")
    assert v2.identity == "weight_v000002"
    idx = json.loads((v2.path / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["version"] == "000002" and idx["metadata"]["base_version"] == "000001"
    assert set(idx["weight_map"].values()) == {"model-00000-of-00001.safetensors"}
    v3 = encode_snapshot(new, chain, flavor="slime")  # a full snapshot restarts the chain
    assert v3.identity == "weight_v000003" and v3.kind == "full"
    reconstruct(chain, "2", tmp_path / "v2", boot_dir=base)
    assert load_bytes(tmp_path / "v2") == load_bytes(base)
    reconstruct(chain, "weight_v000001", tmp_path / "v1", boot_dir=base)
    assert load_bytes(tmp_path / "v1") == load_bytes(new)
    reconstruct(chain, "000003", tmp_path / "v3")
    assert load_bytes(tmp_path / "v3") == load_bytes(new)
    assert len(verify_chain(chain, boot_dir=base)) == 2


def test_long_chain_with_fulls_and_many_deltas_reconstructs_every_version(tmp_path):
    rng = np.random.default_rng(1)
    state = {f"w{i}": random_tensor(rng, dt, (33, 17)) for i, dt in enumerate(TORCH_DTYPES)}
    chain = tmp_path / "chain"
    versions = []
    prev = None
    for step in range(1, 31):
        state = {n: perturb(rng, t, 0.02 if step % 3 else 0.0) for n, t in state.items()}
        ckpt = save_torch_checkpoint(tmp_path / f"ckpt-{step}", state)
        restart = step in (1, 17)
        r = encode_snapshot(ckpt, chain, base_dir=None if restart else prev, step=step)
        versions.append((r.identity, ckpt, r.kind))
        prev = ckpt
    assert [k for _, _, k in versions].count("full") == 2
    for identity, ckpt, _ in versions:
        out = tmp_path / f"out-{identity}"
        reconstruct(chain, identity, out)
        assert load_bytes(out) == load_bytes(ckpt), identity
    paths = verify_chain(chain)
    assert sum(len(p.deltas) for p in paths) == 28
    rows = inspect_chain(chain)
    assert [r.name for r in rows] == [v for v, _, _ in versions]
    unchanged = [r for r in rows if r.kind == "delta" and r.changed_tensors == 0]
    assert unchanged  # steps where nothing changed are empty deltas


def test_apply_from_a_held_checkpoint_applies_only_later_deltas(model_pair, tmp_path):
    base, new = model_pair
    chain = tmp_path / "chain"
    full = encode_snapshot(base, chain)
    d1 = encode_snapshot(new, chain, base_dir=base, step=8)
    d2 = encode_snapshot(base, chain, base_dir=new, step=9)
    held = tmp_path / "held"
    reconstruct(chain, d1.identity, held)
    r = reconstruct(chain, d2.identity, tmp_path / "next", held_dir=held)
    assert r.deltas == [d2.identity]
    assert load_bytes(tmp_path / "next") == load_bytes(base)
    assert full.identity not in r.start


def test_redoing_a_step_gives_the_same_identity_and_bytes(model_pair, tmp_path):
    base, new = model_pair
    a = encode_snapshot(new, tmp_path / "a", base_dir=base, base_identity="base-1", run="r")
    b = encode_snapshot(new, tmp_path / "b", base_dir=base, base_identity="base-1", run="r")
    assert a.identity == b.identity
    for f in a.path.iterdir():
        assert f.read_bytes() == (b.path / f.name).read_bytes()
    c = encode_snapshot(new, tmp_path / "c", base_dir=base, base_identity="base-1", run="other")
    assert c.identity != a.identity


def test_reads_chains_written_by_the_reference_producer(model_pair, tmp_path):
    """A delta written the way Axolotl/slime write it (one-shot zstd, safetensors.numpy) applies."""
    from safetensors.numpy import save_file

    base, new = model_pair
    chain = tmp_path / "chain"
    encode_snapshot(base, chain, identity="step-00000001-aaaa")
    old_t, new_t = load_bytes(base), load_bytes(new)
    frames, sums = {}, {}
    for name, (_, _, raw) in new_t.items():
        xor = np.bitwise_xor(np.frombuffer(raw, np.uint8), np.frombuffer(old_t[name][2], np.uint8))
        if xor.any():
            frames[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(xor.tobytes()), np.uint8)
            sums[name] = "%08x" % zlib.adler32(raw)
    d = chain / "step-00000002-bbbb"
    d.mkdir()
    save_file(frames, str(d / "model-00000.safetensors"), metadata=sums)
    (d / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"version": "step-00000002-bbbb", "base_version": "step-00000001-aaaa",
                     "delta_encoding": "xor", "compression_format": "zstd", "checksum_format": "adler32"},
        "weight_map": {n: "model-00000.safetensors" for n in frames}}))
    reconstruct(chain, "step-00000002-bbbb", tmp_path / "out")
    assert load_bytes(tmp_path / "out") == new_t


DTYPES = st.sampled_from(sorted(TORCH_DTYPES))
SHAPES = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.dictionaries(st.from_regex(r"[a-z][a-z0-9_.]{0,12}", fullmatch=True), st.tuples(DTYPES, SHAPES),
                          min_size=1, max_size=6),
    fraction=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
    flavor=st.sampled_from(["coreweave", "slime"]),
    shard_limit=st.sampled_from([1, 64, 1 << 30]),
)
def test_property_round_trip(specs, fraction, seed, flavor, shard_limit):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = {n: random_tensor(rng, d, s) for n, (d, s) in specs.items()}
        new = {n: perturb(rng, t, fraction) for n, t in base.items()}
        bdir = save_torch_checkpoint(tmp / "base", base)
        ndir = save_torch_checkpoint(tmp / "new", new)
        chain = tmp / "chain"
        full = encode_snapshot(bdir, chain, flavor=flavor, max_shard_bytes=shard_limit, durable=False)
        delta = encode_snapshot(ndir, chain, base_dir=bdir, flavor=flavor, max_shard_bytes=shard_limit,
                                durable=False)
        reconstruct(chain, delta.identity, tmp / "out-new", durable=False)
        reconstruct(chain, full.identity, tmp / "out-base", durable=False)
        assert load_bytes(tmp / "out-new") == load_bytes(ndir)
        assert load_bytes(tmp / "out-base") == load_bytes(bdir)


def test_sparse_changes_across_slices_and_windows_round_trip(tmp_path):
    """Tensors over several slices and mapped windows, changed only here and there: zero slices
    held back before, between and after changes still decode to the exact XOR stream."""
    from posttrain.chain.checkpoint import CHUNK_BYTES
    from posttrain.chain.encode import SLICE_BYTES
    from posttrain.testing.synthetic import write_checkpoint

    rng = np.random.default_rng(3)
    n = (2 * CHUNK_BYTES + 3 * SLICE_BYTES + 4097) // 2  # bf16 elements: windows, slices and a ragged tail
    base = {name: rng.integers(0, 1 << 16, n, dtype=np.uint16) for name in ("first", "middle", "last", "same")}
    new = {name: a.copy() for name, a in base.items()}
    new["first"][5] ^= 1  # only in the first slice: every later slice is trailing zeros
    new["middle"][(CHUNK_BYTES + 5 * SLICE_BYTES // 2) // 2] ^= 0x80  # in the second window
    new["last"][-1] ^= 0x100  # only in the ragged tail: everything before is held back
    bdir = write_checkpoint(tmp_path / "base", {k: ("BF16", v) for k, v in base.items()})
    ndir = write_checkpoint(tmp_path / "new", {k: ("BF16", v) for k, v in new.items()})
    chain = tmp_path / "chain"
    encode_snapshot(bdir, chain, identity="base", durable=False)
    delta = encode_snapshot(ndir, chain, base_dir=bdir, identity="new", durable=False)
    assert delta.changed_tensors == 3 and delta.density == 3 / (4 * 2 * n)
    index = json.loads((delta.path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["first", "last", "middle"]
    assert not list(delta.path.glob(".spool*"))
    with safe_open(str(delta.path / "model-00000.safetensors"), framework="numpy") as f:
        meta = f.metadata()
        for name in ("first", "middle", "last"):
            frame = f.get_tensor(name).tobytes()
            assert zstandard.get_frame_parameters(frame).content_size == 2 * n
            assert zstandard.ZstdDecompressor().decompress(frame) == np.bitwise_xor(new[name], base[name]).tobytes()
            assert meta[name] == "%08x" % zlib.adler32(new[name].tobytes())
    reconstruct(chain, "new", tmp_path / "out", durable=False)
    assert load_bytes(tmp_path / "out") == load_bytes(ndir)


def test_encode_apply_and_verify_leave_no_descriptor_open(model_pair, tmp_path):
    """A long-running server encodes and applies version after version: every descriptor a call
    opens (in any worker thread) is closed when it returns, so deleted folders free their space."""
    import os

    def open_fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    base, new = model_pair
    before = open_fds()
    for i in range(3):
        chain = tmp_path / f"chain-{i}"
        encode_snapshot(base, chain, step=6, workers=2)
        delta = encode_snapshot(new, chain, base_dir=base, workers=2)
        reconstruct(chain, delta.identity, tmp_path / f"out-{i}", workers=2)
        verify_chain(chain)
    leaked = sorted(p for p in open_fds() - before if str(tmp_path) in p)
    assert leaked == []


def test_a_full_snapshot_taken_into_place_is_checked_first_and_rebuilds_exactly(model_pair, tmp_path):
    """reconstruct(take_full=True), as a hot-load does with its download cache: a full snapshot's
    shards move into the rebuilt folder once every tensor matches its recorded digest; a shard whose
    bytes changed is refused and nothing moves."""
    from posttrain.chain.errors import ChainError
    from posttrain.chain.manifest import load_manifest

    base, _ = model_pair
    chain = tmp_path / "chain"
    full = encode_snapshot(base, chain, step=6)
    shard = full.path / "model-00000.safetensors"
    out = tmp_path / "taken"
    reconstruct(chain, full.identity, out, take_full=True, durable=False)
    assert load_bytes(out) == load_bytes(base)
    assert not shard.exists() and (out / shard.name).exists()  # moved, not copied
    load_manifest(out).check_all(deep=True)  # the rebuilt folder's own checksums (a restart checks them)
    assert json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["version"] == full.identity

    again = encode_snapshot(base, tmp_path / "chain2", step=6)
    shard = again.path / "model-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a byte of the last tensor, after the download was checked
    shard.write_bytes(bytes(data))
    with pytest.raises(ChainError):
        reconstruct(tmp_path / "chain2", again.identity, tmp_path / "refused", take_full=True)
    assert shard.exists() and not (tmp_path / "refused").exists()
