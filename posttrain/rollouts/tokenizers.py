"""The tokenizer a process's rollout shards share: loaded once per tokenizer, not once per shard.

A round's shards all tokenize with the policy checkpoint's tokenizer, and every checkpoint of a run
carries the same tokenizer files. Loading it per shard cost a round 64 loads at 64 shards: 5 ms each
for the tiny model's, about 1 s each for a 150,000-token vocabulary (its tokenizer.json is 10 MB of
JSON to parse, holding the GIL). So a process loads each distinct tokenizer once, keyed by the
digest of the files transformers reads to build it, whichever checkpoint folder they sit in.

A fast tokenizer is not to be used from two threads at once (its Rust half is borrowed mutably
when truncation or padding change: "Already borrowed"), so the shards' calls take turns. They are
short and hold the GIL anyway: a chat template and an encode per prompt, a decode per completion.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import xxhash

# What AutoTokenizer reads from a folder (config.json names the class when tokenizer_config.json
# does not). A checkpoint's other files (weights, trainer state) change every step and are left out.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "config.json",
)
CHAT_TEMPLATES_DIR = "additional_chat_templates"
MAX_TOKENIZERS = 4

# transformers resolves its names lazily, and not thread-safely: the first shards of a fresh process,
# importing it at once from their threads, failed with "cannot import name 'AutoTokenizer'". Loads
# take turns under this lock.
_LOAD_LOCK = threading.Lock()
_TOKENIZERS: OrderedDict[str, SharedTokenizer] = OrderedDict()
_DIGESTS: dict[tuple, str] = {}  # (folder, its tokenizer files' names, sizes and mtimes) -> digest


class SharedTokenizer:
    """A tokenizer whose calls take turns: what ``run_shard`` uses of one (``apply_chat_template``,
    ``decode``, ``len``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self.tokenizer.apply_chat_template(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self.tokenizer.decode(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)


def _tokenizer_files(folder: Path) -> list[Path]:
    files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    templates = folder / CHAT_TEMPLATES_DIR
    if templates.is_dir():
        files += sorted(p for p in templates.iterdir() if p.is_file())
    return files


def tokenizer_digest(folder: str | Path) -> str:
    """The digest of the tokenizer files in ``folder``: equal for two checkpoints of one run. Each
    folder is read once while its files keep their sizes and modification times."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: the tokenizer folder does not exist")
    files = _tokenizer_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES[:3])})")
    stats = [(p, p.stat()) for p in files]
    signature = (str(folder.resolve()), *((p.name, st.st_size, st.st_mtime_ns) for p, st in stats))
    digest = _DIGESTS.get(signature)
    if digest is None:
        h = xxhash.xxh3_128()
        for p, st in stats:
            h.update(f"{p.relative_to(folder)}\0{st.st_size}\0".encode())
            h.update(p.read_bytes())
        if len(_DIGESTS) >= 1024:
            _DIGESTS.clear()
        digest = _DIGESTS[signature] = h.hexdigest()
    return digest


def shard_tokenizer(folder: str | Path) -> SharedTokenizer:
    """The process's tokenizer for the files in ``folder``, loaded on the first call for them."""
    digest = tokenizer_digest(folder)
    with _LOAD_LOCK:
        shared = _TOKENIZERS.get(digest)
        if shared is None:
            from transformers import AutoTokenizer

            shared = SharedTokenizer(AutoTokenizer.from_pretrained(str(folder)))
            _TOKENIZERS[digest] = shared
            while len(_TOKENIZERS) > MAX_TOKENIZERS:
                _TOKENIZERS.popitem(last=False)
        _TOKENIZERS.move_to_end(digest)
        return shared
