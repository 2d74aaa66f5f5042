"""A process's shards share one tokenizer per set of tokenizer files: loaded once across a run's
checkpoints, again when the files change, and used by one thread at a time."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import OrderedDict

import pytest

from posttrain.rollouts import tokenizers
from posttrain.rollouts.shard import chat_prompt_ids
from posttrain.rollouts.tokenizers import TOKENIZER_FILES, shard_tokenizer

MESSAGES = [{"role": "user", "content": "what is 2 + 2?"}]


@pytest.fixture
def loads(monkeypatch):
    """Empty caches, and the folders transformers was asked to load, in order."""
    import transformers

    monkeypatch.setattr(tokenizers, "_TOKENIZERS", OrderedDict())
    monkeypatch.setattr(tokenizers, "_DIGESTS", {})
    seen, real = [], transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        seen.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return seen


def checkpoint(src, dst, weights: bytes):
    """A checkpoint folder: the model's tokenizer files, with weights and trainer state of its own."""
    dst.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    (dst / "model.safetensors").write_bytes(weights)
    (dst / "trainer_state.json").write_text(json.dumps({"global_step": len(weights)}))
    return dst


def test_the_checkpoints_of_a_run_share_one_load(tiny_model_dir, tmp_path, loads):
    from transformers import AutoTokenizer

    first = checkpoint(tiny_model_dir, tmp_path / "checkpoint-1", b"1")
    second = checkpoint(tiny_model_dir, tmp_path / "checkpoint-2", b"22")
    a, b = shard_tokenizer(first), shard_tokenizer(second)
    assert a is b and loads == [str(first)]
    fresh = AutoTokenizer.from_pretrained(str(second))
    assert chat_prompt_ids(b, MESSAGES) == chat_prompt_ids(fresh, MESSAGES)
    assert b.decode([5, 6, 7], skip_special_tokens=True) == fresh.decode([5, 6, 7], skip_special_tokens=True)


def test_changed_tokenizer_files_are_loaded_again(tiny_model_dir, tmp_path, loads):
    folder = checkpoint(tiny_model_dir, tmp_path / "checkpoint-1", b"1")
    before = chat_prompt_ids(shard_tokenizer(folder), MESSAGES)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "PROMPT {{ messages[0]['content'] }}"
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # newer transformers keep it beside
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    after = chat_prompt_ids(shard_tokenizer(folder), MESSAGES)
    assert loads == [str(folder), str(folder)] and after != before


def test_a_folder_without_tokenizer_files_or_missing_is_named(tmp_path, loads):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no tokenizer files"):
        shard_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'checkpoint-9'}: the tokenizer folder does not exist"):
        shard_tokenizer(tmp_path / "checkpoint-9")
    assert loads == []


def test_calls_from_the_shards_threads_take_turns():
    """A fast tokenizer used from two threads at once can fail ("Already borrowed"): the shared one
    lets one call in at a time, which a tokenizer that records overlapping calls checks."""

    class Recording:
        inside = most = 0

        def decode(self, ids, **kwargs):
            self.inside += 1
            self.most = max(self.most, self.inside)
            time.sleep(0.01)  # lets the other threads in, were there no turns
            self.inside -= 1
            return str(ids)

        apply_chat_template = decode

    recording = Recording()
    shared = tokenizers.SharedTokenizer(recording)
    threads = [threading.Thread(target=lambda i=i: (shared.decode([i]), shared.apply_chat_template([i])))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert recording.most == 1
