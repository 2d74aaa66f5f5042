"""Bad input: a clear error naming the file, tensor or snapshot, and nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from posttrain.chain import ChecksumMismatch, FormatError, LayoutMismatch, OutputExists, WrongBase
from posttrain.chain.manifest import MANIFEST_NAME
from posttrain.chain.ops import encode_snapshot, reconstruct, verify_chain
from posttrain.chain.safetensors_io import read_header
from tests.support.tensors import save_torch_checkpoint


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} if path.exists() else {}


@pytest.fixture
def chain(model_pair, tmp_path):
    base, new = model_pair
    chain = tmp_path / "chain"
    full = encode_snapshot(base, chain, identity="full-1")
    delta = encode_snapshot(new, chain, base_dir=base, identity="delta-2")
    return chain, full, delta, base, new


def expect_nothing_written(chain_dir: Path, fn, exc, match: str):
    before = tree(chain_dir)
    with pytest.raises(exc, match=match):
        fn()
    assert tree(chain_dir) == before
    assert not [p for p in chain_dir.iterdir() if p.name.startswith(".tmp")] if chain_dir.exists() else True


def test_truncated_shard(model_pair, tmp_path):
    base, new = model_pair
    shard = new / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-5])
    expect_nothing_written(tmp_path / "c", lambda: encode_snapshot(new, tmp_path / "c"), FormatError,
                           r"model-00001-of-00002.safetensors: truncated")


def test_header_longer_than_file(model_pair, tmp_path):
    base, _ = model_pair
    shard = base / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(data) + 10) + data[8:])
    with pytest.raises(FormatError, match=r"model.safetensors: header length \d+ runs past the end"):
        encode_snapshot(base, tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_absurd_header_length(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(FormatError, match="absurdly large"):
        read_header(f)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(FormatError, match="truncated"):
        read_header(f)


def test_index_naming_a_missing_tensor_or_file(model_pair, tmp_path):
    _, new = model_pair
    index_path = new / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"'ghost.weight'"):
        encode_snapshot(new, tmp_path / "c")
    index["weight_map"]["ghost.weight"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"model-00009-of-00009.safetensors.*does not exist"):
        encode_snapshot(new, tmp_path / "c")


@pytest.mark.parametrize("change", ["name", "shape", "dtype"])
def test_layout_change_against_the_base(chain, tmp_path, change):
    chain_dir, full, _, base, _ = chain
    from safetensors.torch import load_file

    tensors = load_file(str(base / "model.safetensors"))
    if change == "name":
        tensors["renamed"] = tensors.pop("layer.0.w")
    elif change == "shape":
        tensors["layer.0.w"] = tensors["layer.0.w"].reshape(64, 16)
    else:
        tensors["layer.0.w"] = tensors["layer.0.w"].to(torch.float16)
    other = save_torch_checkpoint(tmp_path / "other", tensors)
    expect_nothing_written(chain_dir, lambda: encode_snapshot(other, chain_dir, base_dir=base),
                           LayoutMismatch, r"layer.0.w.*write a full snapshot")


@pytest.mark.parametrize("identity", ["../x", "a/b", "", ".hidden", "x y"])
def test_identity_must_be_one_path_segment(chain, identity):
    chain_dir, _, _, base, new = chain
    expect_nothing_written(chain_dir, lambda: encode_snapshot(new, chain_dir, identity=identity),
                           FormatError, "identity")
    expect_nothing_written(chain_dir, lambda: encode_snapshot(new, chain_dir, base_dir=base, base_identity=identity),
                           FormatError, "base identity")


def test_delta_applied_to_the_wrong_base(chain, tmp_path):
    chain_dir, full, delta, base, new = chain
    # a second delta whose base is delta-2, applied from a checkpoint holding another version
    encode_snapshot(base, chain_dir, base_dir=new, identity="delta-3")
    held_full = tmp_path / "held-full"
    reconstruct(chain_dir, "full-1", held_full)
    index = json.loads((held_full / "model.safetensors.index.json").read_text())
    index["metadata"]["version"] = "something-else"
    (held_full / "model.safetensors.index.json").write_text(json.dumps(index))
    (held_full / MANIFEST_NAME).unlink()  # else the edit is refused as corruption
    with pytest.raises(WrongBase, match="holds something-else"):
        reconstruct(chain_dir, "delta-3", tmp_path / "o2", held_dir=held_full)
    assert not (tmp_path / "o2").exists()


def test_delta_on_wrong_bytes_fails_its_checksum(chain, tmp_path):
    chain_dir, full, delta, base, new = chain
    # swap the full snapshot's bytes for the new model: delta-2's checksums cannot match
    victim = full.path / "model-00000.safetensors"
    rebuilt = tmp_path / "as-new"
    encode_snapshot(new, tmp_path / "c2", identity="n")
    victim.write_bytes((tmp_path / "c2" / "n" / "model-00000.safetensors").read_bytes())
    (full.path / MANIFEST_NAME).unlink()  # a chain of another producer: only the delta's checksums
    with pytest.raises(ChecksumMismatch, match=r"delta-2.*applied to a base other than full-1"):
        reconstruct(chain_dir, "delta-2", rebuilt)
    assert not rebuilt.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_corrupted_zstd_stream(chain, tmp_path):
    chain_dir, _, delta, _, _ = chain
    shard = delta.path / "model-00000.safetensors"
    header = read_header(shard)
    data = bytearray(shard.read_bytes())
    biggest = max(header.tensors.values(), key=lambda t: t.nbytes)
    data[biggest.offset: biggest.offset + 4] = b"\x00\x00\x00\x00"  # destroy the frame magic
    shard.write_bytes(bytes(data))
    (delta.path / MANIFEST_NAME).unlink()  # a chain of another producer: the stream itself is checked
    with pytest.raises(FormatError, match=rf"{biggest.name}.*corrupted zstd stream"):
        reconstruct(chain_dir, "delta-2", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(FormatError, match="corrupted zstd stream"):
        verify_chain(chain_dir)


def test_checksum_mismatch(chain, tmp_path):
    chain_dir, _, delta, _, _ = chain
    shard = delta.path / "model-00000.safetensors"
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header["__metadata__"])
    old = header["__metadata__"][name]
    new_sum = "%08x" % ((int(old, 16) + 1) & 0xFFFFFFFF)
    shard.write_bytes(raw.replace(old.encode(), new_sum.encode(), 1))
    (delta.path / MANIFEST_NAME).unlink()  # a chain of another producer: the format's checksums
    with pytest.raises(ChecksumMismatch, match=rf"{name}.*recorded {new_sum}"):
        verify_chain(chain_dir)


def test_output_folder_that_already_exists(chain, tmp_path):
    chain_dir, full, delta, base, new = chain
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExists, match="already exists"):
        reconstruct(chain_dir, "delta-2", out)
    assert tree(out) == {"keep.txt": b"mine"}
    expect_nothing_written(chain_dir, lambda: encode_snapshot(new, chain_dir, base_dir=base, identity="delta-2"),
                           OutputExists, "delta-2 already exists")


def test_missing_base_snapshot_is_named(chain, tmp_path):
    chain_dir, full, delta, base, new = chain
    import shutil

    shutil.rmtree(full.path)
    with pytest.raises(FormatError, match="its base 'full-1' is not in"):
        reconstruct(chain_dir, "delta-2", tmp_path / "out")
