"""The Store contract, run against LocalStore, S3Store on moto and S3Store on SeaweedFS."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.storage import NotFound, PreconditionFailed, S3Store, Store


def test_bytes_round_trip(store: Store) -> None:
    etag = store.put_bytes("a/b.txt", b"hello")
    data, etag2 = store.get_bytes("a/b.txt")
    assert data == b"hello" and etag == etag2
    assert store.exists("a/b.txt") and store.size("a/b.txt") == 5
    assert not store.exists("a/b") and not store.exists("a")
    etag3 = store.put_bytes("a/b.txt", b"hello again")  # overwrite
    assert etag3 != etag and store.get_bytes("a/b.txt")[0] == b"hello again"
    assert store.put_bytes("empty", b"") and store.get_bytes("empty")[0] == b"" and store.size("empty") == 0


def test_missing_keys(store: Store, tmp_path: Path) -> None:
    for call in (lambda: store.get_bytes("nope"), lambda: store.size("nope")):
        with pytest.raises(NotFound, match="nope"):
            call()
    assert not store.exists("nope")
    with pytest.raises(NotFound, match="nope"):
        store.get_file("nope", tmp_path / "dl" / "out.bin")
    assert not (tmp_path / "dl" / "out.bin").exists()
    assert [p.name for p in (tmp_path / "dl").iterdir()] == []  # no temporary file left


def test_delete(store: Store) -> None:
    for key in ("d/1", "d/2", "d/3", "keep"):
        store.put_bytes(key, b"x")
    store.delete(["d/1", "d/2", "d/missing"])
    assert list(store.list()) == ["d/3", "keep"]
    store.delete(iter(["d/3"]))
    store.delete([])
    assert list(store.list()) == ["keep"]


def test_list_prefixes(store: Store) -> None:
    keys = ["a/b/c", "a/b1", "a/bc", "a/c", "ab", "b/a"]
    for key in keys:
        store.put_bytes(key, key.encode())
    assert list(store.list()) == sorted(keys)
    assert list(store.list("a/")) == ["a/b/c", "a/b1", "a/bc", "a/c"]
    assert list(store.list("a/b")) == ["a/b/c", "a/b1", "a/bc"]  # a string prefix, not a folder
    assert list(store.list("a/b/")) == ["a/b/c"]
    assert list(store.list("a")) == ["a/b/c", "a/b1", "a/bc", "a/c", "ab"]
    assert list(store.list("zzz")) == [] and list(store.list("zzz/")) == []


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_list_paginates(store_factory: Callable[..., Store], kind: str) -> None:
    keys = sorted(f"p/{i:03d}" for i in range(23))
    store = store_factory(kind, list_page_size=5)
    assert isinstance(store, S3Store)
    for key in keys:
        store.put_bytes(key, b"1")
    store.put_bytes("q/other", b"1")
    calls = []
    store.client.meta.events.register("before-call.s3.ListObjectsV2", lambda **kw: calls.append(1))
    assert list(store.list("p/")) == keys
    assert len(calls) == 5  # 23 keys, 5 per page


def test_conditional_writes(store: Store) -> None:
    etag = store.put_bytes("ledger/latest", b"v1", if_none_match=True)
    with pytest.raises(PreconditionFailed, match="ledger/latest"):
        store.put_bytes("ledger/latest", b"v1-again", if_none_match=True)
    etag2 = store.put_bytes("ledger/latest", b"v2", if_match=etag)
    assert store.get_bytes("ledger/latest") == (b"v2", etag2)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("ledger/latest", b"v3", if_match=etag)  # stale
    assert store.get_bytes("ledger/latest")[0] == b"v2"
    with pytest.raises(PreconditionFailed):
        store.put_bytes("ledger/missing", b"x", if_match=etag2)
    with pytest.raises(ValueError, match="not both"):
        store.put_bytes("ledger/latest", b"x", if_none_match=True, if_match=etag2)


def test_conditional_create_has_one_winner(store: Store) -> None:
    wins: list[int] = []
    lost: list[int] = []
    barrier = threading.Barrier(6)

    def claim(i: int) -> None:
        barrier.wait()
        try:
            store.put_bytes("claim", str(i).encode(), if_none_match=True)
            wins.append(i)
        except PreconditionFailed:
            lost.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(lost) == 5
    assert store.get_bytes("claim")[0] == str(wins[0]).encode()


def test_files_round_trip(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"0123456789" * 1000)
    store.put_file(src, "f/data.bin")
    src.write_bytes(b"changed later")  # the store holds a copy
    dest = tmp_path / "new" / "dir" / "data.bin"
    store.get_file("f/data.bin", dest)
    assert dest.read_bytes() == b"0123456789" * 1000 and store.size("f/data.bin") == 10000
    dest.write_bytes(b"old content, longer than the object " * 1000)
    store.get_file("f/data.bin", dest)  # replaces an existing file
    assert dest.read_bytes() == b"0123456789" * 1000
    assert sorted(p.name for p in dest.parent.iterdir()) == ["data.bin"]
    with pytest.raises(FileNotFoundError):
        store.put_file(tmp_path / "absent.bin", "f/x")


def test_str_and_repr_name_the_store(store: Store) -> None:
    assert str(store) == store.uri
    assert store.uri.startswith(("file:///", "s3://"))
    assert type(store).__name__ in repr(store)
