"""Key and prefix rules, and that every store applies them before any I/O."""

from __future__ import annotations

import pytest

from posttrain.storage import InvalidKey, LocalStore, S3Store, S3StoreConfig
from posttrain.storage.keys import check_key, check_prefix

GOOD = ["a", "a/b", "snapshots/000012/model-00001.safetensors", "x y/ü", "a.b/c..d", ".hidden/x"]
BAD = {
    "": "empty",
    "/a": "leading '/'",
    "a//b": "empty segment",
    "a/": "empty segment",
    "../a": "'..' segment",
    "a/../b": "'..' segment",
    "a/./b": "'.' segment",
    "a\x00b": "NUL",
    "k" * 1025: "longer than",
}


@pytest.mark.parametrize("key", GOOD)
def test_good_keys(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize("key,why", BAD.items(), ids=[repr(k)[:20] for k in BAD])
def test_bad_keys_name_the_key(key: str, why: str) -> None:
    with pytest.raises(InvalidKey) as err:
        check_key(key)
    assert repr(key)[:50] in str(err.value) and why in str(err.value)


def test_prefixes() -> None:
    for prefix in ["", "a", "a/", "a/b", "snapshots/0000"]:
        assert check_prefix(prefix) == prefix
    for prefix in ["/", "/a", "a//", "../", "a/../"]:
        with pytest.raises(InvalidKey, match="invalid prefix"):
            check_prefix(prefix)


def _stores(tmp_path):  # noqa: ANN001, ANN202
    # the S3 store points at a closed port: key checks must fail before any request
    s3 = S3Store(S3StoreConfig(bucket="bucket", endpoint_url="http://127.0.0.1:9", max_attempts=1))
    return [LocalStore(tmp_path), s3]


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", ""])
def test_stores_reject_bad_keys(tmp_path, key: str) -> None:  # noqa: ANN001
    for store in _stores(tmp_path):
        for call in (
            lambda: store.put_bytes(key, b"x"),
            lambda: store.get_bytes(key),
            lambda: store.exists(key),
            lambda: store.size(key),
            lambda: store.delete(["ok", key]),
            lambda: store.get_file(key, tmp_path / "out"),
            lambda: store.put_file(__file__, key),
        ):
            with pytest.raises(InvalidKey, match="invalid key"):
                call()
        with pytest.raises(InvalidKey, match="invalid prefix"):
            list(store.list("/abs"))
    assert not (tmp_path.parent / "escape").exists()


def test_local_store_reserves_its_meta_folder(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(InvalidKey, match="reserved"):
        LocalStore(tmp_path).put_bytes(".posttrain-store/lock", b"x")
