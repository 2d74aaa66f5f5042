"""The chain carries the checkpoint's probe (posttrain.probe.json): full and delta snapshots hold it
under their checksums, a rebuilt folder gets the target version's, byte for byte; chains without
probes work as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posttrain.chain import ChainError, ChecksumMismatch
from posttrain.chain.fetch import SnapshotSource
from posttrain.chain.manifest import MANIFEST_NAME
from posttrain.chain.ops import encode_snapshot, reconstruct, verify_chain
from posttrain.chain.probe import PROBE_NAME, Probe, probe_prompts, read_probe, write_probe
from posttrain.storage import LocalStore
from tests.support.tensors import load_bytes


def _probe(seed: float) -> Probe:
    prompts = probe_prompts(64)
    return Probe(dtype="bfloat16", vocab_size=64, prompts=prompts,
                 completions=[[(i + j) % 64 for j in range(8)] for i in range(4)],
                 logprobs=[[-(seed + 0.125 * j + i) for j in range(8)] for i in range(4)])


@pytest.fixture
def probed_pair(model_pair):
    base, new = model_pair
    write_probe(base, _probe(1.0))
    write_probe(new, _probe(2.0))
    return base, new


def _manifest_files(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())["files"]


@pytest.mark.parametrize("flavor", ["coreweave", "slime"])
def test_full_and_delta_snapshots_carry_the_probe_and_rebuilds_get_the_targets(probed_pair, tmp_path, flavor):
    base, new = probed_pair
    chain = tmp_path / "chain"
    full = encode_snapshot(base, chain, step=6, flavor=flavor)
    delta = encode_snapshot(new, chain, base_dir=base, flavor=flavor)
    for snap, src in ((full, base), (delta, new)):
        assert (snap.path / PROBE_NAME).read_bytes() == (src / PROBE_NAME).read_bytes()
        assert PROBE_NAME in _manifest_files(snap.path)  # under the snapshot's checksums
    # the format's readers are unaffected: the index names shards only
    index = json.loads((delta.path / "model.safetensors.index.json").read_text())
    assert all(v.endswith(".safetensors") for v in index["weight_map"].values())

    rebuilt = reconstruct(chain, delta.identity, tmp_path / "v-new").path
    assert (rebuilt / PROBE_NAME).read_bytes() == (new / PROBE_NAME).read_bytes()
    assert read_probe(rebuilt) == _probe(2.0)
    assert load_bytes(rebuilt) == load_bytes(new)
    assert PROBE_NAME in _manifest_files(rebuilt)
    first = reconstruct(chain, full.identity, tmp_path / "v-base").path
    assert (first / PROBE_NAME).read_bytes() == (base / PROBE_NAME).read_bytes()
    # from a held version (what a hot-load does): the target's probe, not the held one's
    again = reconstruct(chain, delta.identity, tmp_path / "v-new-held", held_dir=first).path
    assert (again / PROBE_NAME).read_bytes() == (new / PROBE_NAME).read_bytes()
    assert len(verify_chain(chain)) == 1


def test_a_version_without_a_probe_never_gets_its_bases(probed_pair, tmp_path):
    base, new = probed_pair
    (new / PROBE_NAME).unlink()
    chain = tmp_path / "chain"
    encode_snapshot(base, chain, step=6)
    delta = encode_snapshot(new, chain, base_dir=base)
    assert not (delta.path / PROBE_NAME).exists()
    rebuilt = reconstruct(chain, delta.identity, tmp_path / "out").path
    assert not (rebuilt / PROBE_NAME).exists()
    assert load_bytes(rebuilt) == load_bytes(new)


def test_a_chain_without_probes_is_as_before(model_pair, tmp_path):
    base, new = model_pair
    chain = tmp_path / "chain"
    full = encode_snapshot(base, chain, step=6)
    delta = encode_snapshot(new, chain, base_dir=base)
    assert sorted(p.name for p in delta.path.iterdir()) == [
        "model-00000.safetensors", "model.safetensors.index.json", MANIFEST_NAME]
    assert sorted(p.name for p in full.path.iterdir()) == [
        "config.json", "model-00000.safetensors", "model.safetensors.index.json", MANIFEST_NAME]
    rebuilt = reconstruct(chain, delta.identity, tmp_path / "out").path
    assert not (rebuilt / PROBE_NAME).exists() and load_bytes(rebuilt) == load_bytes(new)


def _corrupt(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    i = raw.index(b"-2.125")  # a logprob's digit: the same size, still valid JSON
    raw[i + 1] = ord("3")
    path.write_bytes(bytes(raw))


def test_a_corrupted_probe_fails_its_checksum_by_name(probed_pair, tmp_path):
    base, new = probed_pair
    chain = tmp_path / "chain"
    full = encode_snapshot(base, chain, step=6)
    delta = encode_snapshot(new, chain, base_dir=base)
    _corrupt(delta.path / PROBE_NAME)
    with pytest.raises(ChecksumMismatch) as e:
        reconstruct(chain, delta.identity, tmp_path / "out")
    assert f"snapshot {delta.identity}: file {PROBE_NAME} is corrupted" in str(e.value)
    assert not (tmp_path / "out").exists()
    shutil.copy2(new / PROBE_NAME, delta.path / PROBE_NAME)
    (full.path / PROBE_NAME).write_bytes((full.path / PROBE_NAME).read_bytes().replace(b"-1.125", b"-1.625"))
    with pytest.raises(ChecksumMismatch, match=f"snapshot {full.identity}: file {PROBE_NAME} is corrupted"):
        reconstruct(chain, full.identity, tmp_path / "out-full")


def test_a_malformed_probe_is_not_encoded(probed_pair, tmp_path):
    base, _ = probed_pair
    (base / PROBE_NAME).write_text('{"format": "posttrain-probe-v1"}')
    with pytest.raises(ChainError, match=f"{PROBE_NAME}: not a valid probe"):
        encode_snapshot(base, tmp_path / "chain", step=6)
    assert not any(p for p in (tmp_path / "chain").iterdir() if not p.name.startswith("."))


def test_the_probe_travels_through_a_store(probed_pair, tmp_path):
    """Uploaded like every file of a snapshot folder, fetched, checked, and rebuilt beside the weights."""
    base, new = probed_pair
    chain = tmp_path / "store" / "runs" / "r1"
    encode_snapshot(base, chain, step=6)
    delta = encode_snapshot(new, chain, base_dir=base)
    source = SnapshotSource(LocalStore(tmp_path / "store"), "runs/r1", tmp_path / "cache")
    plan = source.plan(delta.identity, None)
    for name in plan.snapshots:
        assert (source.fetch(name) / PROBE_NAME).is_file()
    view = source.view(plan, None, None, tmp_path / "view")
    out = reconstruct(view, delta.identity, tmp_path / "out").path
    assert (out / PROBE_NAME).read_bytes() == (new / PROBE_NAME).read_bytes()
