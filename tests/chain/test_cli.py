"""The ``posttrain chain`` commands, run as a user runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from posttrain.chain.ops import inspect_chain
from tests.support.tensors import load_bytes


def posttrain(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"posttrain {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def test_encode_apply_verify_inspect(model_pair, tmp_path):
    base, new = model_pair
    chain = tmp_path / "chain"
    full = posttrain("chain", "encode", str(base), "--out", str(chain), "--step", "6")
    assert full.stdout.startswith("full snapshot step-00000006-")
    delta = posttrain("chain", "encode", str(new), "--out", str(chain), "--base", str(base))
    line = delta.stdout.strip()
    assert line.startswith("delta snapshot step-00000007-") and "tensors changed" in line
    assert "% of full" in line and "/s" in line
    identity = line.split()[2]
    assert (chain / identity / "model.safetensors.index.json").exists()

    out = tmp_path / "out"
    applied = posttrain("chain", "apply", str(chain), "--version", identity, "--out", str(out))
    assert f"version {identity}" in applied.stdout and "+ 1 delta," in applied.stdout
    assert load_bytes(out) == load_bytes(new)

    assert "OK, 2 snapshots" in posttrain("chain", "verify", str(chain)).stdout
    inspect = posttrain("chain", "inspect", str(chain), "--density").stdout
    assert "full" in inspect and identity in inspect
    delta_row = next(r for r in inspect.splitlines() if identity in r)
    density = float(delta_row.split("│")[5])
    assert 0 < density < 100

    again = posttrain("chain", "apply", str(chain), "--version", identity, "--out", str(out), check=False)
    assert again.returncode == 2
    assert again.stderr.strip() == f"posttrain: error: {out} already exists; nothing was overwritten"


def test_apply_no_fsync_rebuilds_the_same_bytes_without_syncing_the_shards(model_pair, tmp_path, monkeypatch):
    """``--no-fsync`` skips the fsync of each rebuilt shard file (the index and the folder are still
    written atomically); the bytes are the same."""
    import os

    from posttrain.cli import main

    base, new = model_pair
    chain = tmp_path / "chain"
    posttrain("chain", "encode", str(base), "--out", str(chain), "--identity", "full")
    posttrain("chain", "encode", str(new), "--out", str(chain), "--base", str(base), "--identity", "d1")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert main(["chain", "apply", str(chain), "--version", "d1", "--out", str(tmp_path / "durable")]) == 0
    # the shards, synced in the staging folder before it moves into place
    assert [p for p in synced if p.endswith(".safetensors") and "-durable-" in p], synced
    synced.clear()
    assert main(["chain", "apply", str(chain), "--version", "d1", "--out", str(tmp_path / "scratch"), "--no-fsync"]) == 0
    assert not [p for p in synced if p.endswith(".safetensors")], synced
    assert load_bytes(tmp_path / "scratch") == load_bytes(tmp_path / "durable") == load_bytes(new)


def test_slime_encode_derives_versions(model_pair, tmp_path):
    base, new = model_pair
    chain = tmp_path / "disk"
    posttrain("chain", "encode", str(base), "--out", str(chain), "--flavor", "slime")
    second = posttrain("chain", "encode", str(new), "--out", str(chain), "--base", str(base), "--flavor", "slime")
    assert "weight_v000002 against 000001" in second.stdout
    index = json.loads((chain / "weight_v000002" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["checksum_format"] == "xxh3-128"


def test_bad_identity_is_a_one_line_error(model_pair, tmp_path):
    base, _ = model_pair
    proc = posttrain("chain", "encode", str(base), "--out", str(tmp_path / "c"), "--identity", "../x", check=False)
    assert proc.returncode == 2
    assert "identity '../x' is not one path segment" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("length", [250, 255])
def test_an_identity_up_to_the_longest_allowed_encodes_and_applies(model_pair, tmp_path, length):
    base, new = model_pair
    chain, identity = tmp_path / "chain", "v" + "x" * (length - 1)  # 255: the longest check_identity accepts
    posttrain("chain", "encode", str(base), "--out", str(chain), "--identity", identity)
    posttrain("chain", "encode", str(new), "--out", str(chain), "--base", str(base), "--identity", "d1")
    assert (chain / identity / "model.safetensors.index.json").is_file()
    assert not [p for p in chain.iterdir() if p.name.startswith(".")]  # no staging folder left
    posttrain("chain", "apply", str(chain), "--version", "d1", "--out", str(tmp_path / "out"))
    assert load_bytes(tmp_path / "out") == load_bytes(new)


@pytest.mark.parametrize("command", ["encode", "apply"])
def test_chain_commands_import_neither_torch_nor_prefect(model_pair, tmp_path, command):
    """Nor, on a checkpoint without a probe and with no terminal for a progress bar, pydantic or rich:
    their imports were a tenth of a 1 GiB encode (bench/chain_codec.py)."""
    base, _ = model_pair
    chain = tmp_path / "c"
    posttrain("chain", "encode", str(base), "--out", str(chain), "--identity", "full")
    args = (["encode", str(base), "--out", str(tmp_path / "c2")] if command == "encode"
            else ["apply", str(chain), "--version", "full", "--out", str(tmp_path / "out")])
    code = (
        "import sys\n"
        "from posttrain.cli import main\n"
        f"rc = main(['chain', *{args!r}])\n"
        "heavy = [m for m in ('torch', 'prefect', 'transformers', 'boto3', 'pydantic', 'rich') if m in sys.modules]\n"
        "assert rc == 0 and not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, stdin=subprocess.DEVNULL)


def test_verify_of_a_folder_that_is_not_a_chain_is_an_error(model_pair):
    base, _ = model_pair  # a model folder: files, no snapshot subfolders
    proc = posttrain("chain", "verify", str(base), check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == (f"posttrain: error: {base} holds no snapshots (subfolders with an index); "
                                   "it is not a chain folder")


def test_encode_shows_a_byte_progress_bar_on_a_terminal_only(model_pair, tmp_path):
    import os
    import pty

    base, _ = model_pair
    main_fd, tty_fd = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    with subprocess.Popen([sys.executable, "-m", "posttrain", "chain", "encode", str(base), "--out",
                           str(tmp_path / "tty")], stdout=subprocess.PIPE, stderr=tty_fd, env=env) as proc:
        os.close(tty_fd)
        seen = b""
        while True:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=60) == 0
    os.close(main_fd)
    text = seen.decode(errors="replace")
    assert "encoding" in text and "KiB" in text  # rich's DownloadColumn: bytes done / total

    piped = posttrain("chain", "encode", str(base), "--out", str(tmp_path / "piped"))
    assert piped.stderr == ""



@pytest.fixture
def held_and_later(model_pair, tmp_path):
    """A chain full -> d1 -> d2 -> d3, HELD rebuilt at d1, and the identities of full, d1, d2 and d3."""
    from posttrain.chain.ops import encode_snapshot, reconstruct

    base, new = model_pair
    chain = tmp_path / "chain"
    ids = [encode_snapshot(base, chain, step=7).identity]
    ids += [encode_snapshot(b, chain, base_dir=a, step=s).identity
            for s, (a, b) in enumerate([(base, new), (new, base), (base, new)], start=8)]
    reconstruct(chain, ids[1], tmp_path / "held")
    return chain, tmp_path / "held", ids


def _only(chain, names, dest):
    """A chain folder holding only the snapshots ``names`` of ``chain``."""
    for name in names:
        shutil.copytree(chain / name, dest / name)
    return dest


def test_apply_from_held_needs_only_the_deltas_after_it(model_pair, held_and_later, tmp_path):
    _, new = model_pair
    chain, held, (_, d1, d2, d3) = held_and_later
    later = _only(chain, [d2, d3], tmp_path / "later")  # neither the full snapshot nor d1, HELD's own
    proc = posttrain("chain", "apply", str(later), "--version", d3, "--from", str(held), "--out", str(tmp_path / "o"))
    assert f"version {d3}: {d1} (held by {held}) + 2 deltas" in proc.stdout
    assert load_bytes(tmp_path / "o") == load_bytes(new)
    # the same from a store holding only those deltas: only they are downloaded
    proc = posttrain("chain", "apply", later.as_uri(), "--version", d3, "--from", str(held),
                     "--out", str(tmp_path / "o2"), "--cache", str(tmp_path / "cache"))
    assert "+ 2 deltas" in proc.stdout and load_bytes(tmp_path / "o2") == load_bytes(new)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([d2, d3])


@pytest.mark.parametrize("case", ["a delta missing", "held off the path"])
def test_apply_from_held_that_the_chain_cannot_reach_is_one_line(held_and_later, tmp_path, case):
    chain, held, (full, d1, d2, d3) = held_and_later
    if case == "a delta missing":
        later, first, base, holds = _only(chain, [d3], tmp_path / "later"), d3, d2, d1
    else:  # HELD holds the full snapshot; the chain's first delta builds on d1
        held = tmp_path / "held-full"
        posttrain("chain", "apply", str(chain), "--version", full, "--out", str(held))
        later, first, base, holds = _only(chain, [d2, d3], tmp_path / "later"), d2, d1, full
    proc = posttrain("chain", "apply", str(later), "--version", d3, "--from", str(held), "--out", str(tmp_path / "o"),
                     check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"posttrain: error: {first} builds on {base}, which neither {later} holds nor "
                                  f"{held} (it holds {holds}): the chain lacks a delta between {holds} and {d3}, or ")
    assert not (tmp_path / "o").exists()


def test_inspect_shows_a_full_snapshot_as_100_percent_of_full(model_pair, tmp_path):
    # a full snapshot's files hold its index, config and checksums besides the tensors: against the
    # raw tensor bytes it read "101.90 % of full"; the column compares stored bytes with stored bytes
    base, new = model_pair
    chain = tmp_path / "chain"
    full = posttrain("chain", "encode", str(base), "--out", str(chain), "--step", "6")
    assert "= 100.00% of full" in full.stdout
    posttrain("chain", "encode", str(new), "--out", str(chain), "--base", str(base))
    rows = inspect_chain(chain)
    assert [r.kind for r in rows] == ["full", "delta"]
    assert rows[0].share_of_full == 1.0
    assert rows[1].share_of_full == rows[1].stored_bytes / rows[0].stored_bytes
    table = posttrain("chain", "inspect", str(chain)).stdout
    full_row = next(r for r in table.splitlines() if rows[0].name in r)
    assert float(full_row.split("│")[7]) == 100.0
    delta_row = next(r for r in table.splitlines() if rows[1].name in r)
    assert float(delta_row.split("│")[7]) == round(100 * rows[1].share_of_full, 2)
