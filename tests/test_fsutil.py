"""posttrain.fsutil: files and folders appear whole or not at all, and a failed write leaves
what was there before and no temporary file behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.fsutil import atomic_open, atomic_path, atomic_write, publish_dir, staging_dir


class Boom(Exception):
    pass


def test_atomic_write_text_and_bytes(tmp_path: Path) -> None:
    assert atomic_write(tmp_path / "a.txt", "héllo\n").read_text(encoding="utf-8") == "héllo\n"
    assert atomic_write(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    atomic_write(tmp_path / "a.txt", "second")
    assert (tmp_path / "a.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]


def test_atomic_write_creates_parent_folders(tmp_path: Path) -> None:
    target = tmp_path / "x" / "y" / "z.json"
    atomic_write(target, "{}")
    assert target.read_text() == "{}"


@pytest.mark.parametrize("existing", [True, False])
def test_exception_inside_atomic_open_keeps_old_file_and_leaves_no_temp(tmp_path: Path, existing: bool) -> None:
    target = tmp_path / "state.json"
    if existing:
        target.write_text("old")
    with pytest.raises(Boom), atomic_open(target) as f:
        f.write("half of the new content")
        raise Boom
    assert os.listdir(tmp_path) == (["state.json"] if existing else [])
    if existing:
        assert target.read_text() == "old"


def test_atomic_open_refuses_append_and_read_modes(tmp_path: Path) -> None:
    for mode in ("a", "r", "w+"):
        with pytest.raises(ValueError, match=repr(mode)), atomic_open(tmp_path / "f", mode):
            pass
    assert not (tmp_path / "f").exists()


def test_readers_see_the_old_file_until_the_block_ends(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_text("old")
    with atomic_open(target) as f:
        f.write("new")
        f.flush()
        assert target.read_text() == "old"
    assert target.read_text() == "new"


def test_atomic_path_for_writers_that_need_a_name(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"payload")
    dest = tmp_path / "cache" / "dest"
    for durable in (True, False):
        with atomic_path(dest, durable=durable) as tmp:
            assert tmp.parent == dest.parent and tmp != dest
            tmp.write_bytes(src.read_bytes() + str(durable).encode())
        assert dest.read_bytes() == b"payload" + str(durable).encode()
    with pytest.raises(Boom), atomic_path(dest) as tmp:
        tmp.write_bytes(b"partial")
        raise Boom
    assert os.listdir(dest.parent) == ["dest"]
    assert dest.read_bytes() == b"payloadFalse"


def test_staging_dir_is_removed_unless_published(tmp_path: Path) -> None:
    final = tmp_path / "out" / "snap"
    with pytest.raises(Boom), staging_dir(final) as tmp:
        (tmp / "f").write_text("x")
        raise Boom
    assert os.listdir(final.parent) == []
    with staging_dir(final) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "f").write_text("x")
        assert publish_dir(tmp, final, sync_files=True) == final
    assert os.listdir(final.parent) == ["snap"]
    assert (final / "sub" / "f").read_text() == "x"


def test_publish_dir_never_overwrites(tmp_path: Path) -> None:
    final = tmp_path / "snap"
    final.mkdir()
    (final / "keep").write_text("old")
    with staging_dir(final) as tmp:
        (tmp / "keep").write_text("new")
        with pytest.raises(FileExistsError, match=str(final)):
            publish_dir(tmp, final)
    assert (final / "keep").read_text() == "old"
    assert os.listdir(tmp_path) == ["snap"]


def test_staging_dir_clears_leftovers_of_killed_attempts_only_when_asked(tmp_path: Path) -> None:
    final = tmp_path / "checkpoint-3"
    leftover = tmp_path / ".tmp-checkpoint-3-deadbeef"
    other = tmp_path / ".tmp-checkpoint-30-deadbeef"
    leftover.mkdir()
    other.mkdir()
    with staging_dir(final):
        pass
    assert leftover.exists()
    with staging_dir(final, clear_leftovers=True):
        pass
    assert not leftover.exists()
    assert other.exists()  # another target's staging folder



def test_names_up_to_the_longest_a_file_system_takes_get_temporary_names_too(tmp_path: Path) -> None:
    a, b = "a" * 255, "a" * 254 + "b"  # the longest names; the temporary ones add characters
    atomic_write(tmp_path / a, "file")
    with staging_dir(tmp_path / b) as tmp:
        (tmp / "x").write_text("folder")
        publish_dir(tmp, tmp_path / b)
    assert (tmp_path / a).read_text() == "file" and (tmp_path / b / "x").read_text() == "folder"
    assert sorted(os.listdir(tmp_path)) == [a, b]


def test_long_names_clear_only_their_own_leftovers(tmp_path: Path) -> None:
    a, b = "a" * 255, "a" * 254 + "b"  # shortened alike in temporary names, but for a digest of the whole
    with staging_dir(tmp_path / b) as tmp:
        leftover = tmp.with_name(tmp.name[:-8] + "deadbeef")  # as a killed attempt at b leaves it
    leftover.mkdir()
    with staging_dir(tmp_path / a, clear_leftovers=True):
        pass
    assert leftover.exists()
    with staging_dir(tmp_path / b, clear_leftovers=True):
        pass
    assert not leftover.exists()
