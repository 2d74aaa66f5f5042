"""A checkpoint's save time (the publish lag's start): the newest modification time of its files."""

from __future__ import annotations

import os

from posttrain.publish.content import saved_at


def test_saved_at_is_the_newest_file_time(tmp_path):
    ckpt = tmp_path / "checkpoint-3"
    (ckpt / "sub").mkdir(parents=True)
    for name, when in (("model.safetensors", 1_000.0), ("config.json", 1_500.0), ("sub/state.pt", 1_200.0)):
        (ckpt / name).write_text("x")
        os.utime(ckpt / name, (when, when))
    assert saved_at(ckpt) == 1_500.0
    assert saved_at(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert saved_at(tmp_path / "empty") is None
