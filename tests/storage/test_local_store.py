"""LocalStore specifics: on-disk layout, temporary files, a key under an object."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from posttrain.storage import InvalidKey, LocalStore, PreconditionFailed
from posttrain.storage.local import META_DIR, etag_of


def test_layout_and_meta_folder(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")
    store.put_bytes("a/b.txt", b"x")
    assert (tmp_path / "root" / "a" / "b.txt").read_bytes() == b"x"
    assert list(store.list()) == ["a/b.txt"]  # META_DIR (lock, temporary files) is not listed
    assert (tmp_path / "root" / META_DIR / "lock").exists()
    assert list((tmp_path / "root" / META_DIR / "tmp").iterdir()) == []
    assert store.uri == (tmp_path / "root").as_uri()


def test_etag_is_content_md5(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    etag = store.put_bytes("k", b"abc")
    assert etag == etag_of(b"abc") == '"900150983cd24fb0d6963f7d28e17f72"'
    assert store.put_bytes("k", b"abd", if_match=etag.strip('"')) != etag  # quotes optional


def test_object_and_prefix_cannot_share_a_name(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("a/b", b"x")
    with pytest.raises(InvalidKey, match="a/b/c: a leading part of the key is an object"):
        store.put_bytes("a/b/c", b"y")
    with pytest.raises(InvalidKey, match="prefix of other keys"):
        store.put_bytes("a", b"y")
    assert not store.exists("a") and not store.exists("a/b/c")


def test_delete_prunes_empty_folders(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")
    store.put_bytes("x/y/z", b"1")
    store.delete(["x/y/z"])
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [META_DIR]


def _claim(root: str, i: int) -> bool:
    try:
        LocalStore(root).put_bytes("claim", str(i).encode(), if_none_match=True)
        return True
    except PreconditionFailed:
        return False


def test_conditional_create_across_processes(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(_claim, [(str(tmp_path), i) for i in range(8)])
    assert results.count(True) == 1
