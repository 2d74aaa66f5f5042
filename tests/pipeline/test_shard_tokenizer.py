"""The shards of a round ask for their tokenizer from their threads at once; in a fresh process (a
flow run's first round) transformers' lazy imports raced and most shards failed with "cannot import
name 'AutoTokenizer'". Checked in a fresh interpreter, where nothing imported transformers yet
(tests/rollouts/test_shard_tokenizers.py: what they share, and when it is loaded again)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.pipeline.runs import REPO

SCRIPT = textwrap.dedent("""
    import sys, threading
    from posttrain.rollouts.tokenizers import shard_tokenizer
    assert "transformers" not in sys.modules
    errors, vocab = [], []

    def shard():
        try:
            vocab.append(len(shard_tokenizer(sys.argv[1])))
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
