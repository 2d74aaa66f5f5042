"""The shards of a round load their tokenizers from their threads at once; in a fresh process (a
flow run's first round) transformers' lazy imports raced and most shards failed with "cannot import
name 'AutoTokenizer'". Checked in a fresh interpreter, where nothing imported transformers yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

from tests.pipeline.runs import REPO

SCRIPT = textwrap.dedent("""
    import sys, threading
    from posttrain.pipeline.tasks.rollouts import _load_tokenizer
    assert "transformers" not in sys.modules
    errors, vocab = [], []

    def shard():
        try:
            vocab.append(len(_load_tokenizer(sys.argv[1])))
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=shard) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(vocab)) == 1 and len(vocab) == 8, vocab
    print("ok")
""")


def test_eight_shards_load_their_tokenizers_at_once_in_a_fresh_process(tiny_model_dir):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_after_the_first_load_of_a_folder_the_shards_load_their_tokenizers_in_parallel(monkeypatch):
    """Only the first load runs alone: 64 shards each loading under one lock queued for ~1 s of a
    round. Here the later loads of a folder must all be in ``from_pretrained`` at the same time
    (a barrier of seven), which loads made one at a time never are."""
    import transformers

    from posttrain.pipeline.tasks import rollouts

    calls, barrier = [], threading.Barrier(7, timeout=10)

    def from_pretrained(path):
        calls.append(path)
        if len(calls) > 1:  # the first load is alone by design
            barrier.wait()
        return f"tokenizer of {path}"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(rollouts, "_TOKENIZERS_LOADED", set())
    with ThreadPoolExecutor(8) as shards:  # a broken barrier raises here
        loaded = list(shards.map(lambda _: rollouts._load_tokenizer("ckpt-1"), range(8)))
    assert loaded == ["tokenizer of ckpt-1"] * 8 and len(calls) == 8, calls
