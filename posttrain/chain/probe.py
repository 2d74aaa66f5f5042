"""The probe that travels with a snapshot: ``posttrain.probe.json``.

When the trainer saves a checkpoint it also writes the expected answers of a few fixed prompts,
computed on the weights it saved: for each prompt (token ids derived from the vocabulary size
alone, so every producer and consumer of a model agrees on them) the greedy completion's token
ids and each completion token's logprob (teacher-forced, raw logits, log-softmax in float32),
with the dtype of the weights. An inference engine that holds those weights answers the same
within a dtype's tolerance (``posttrain.serve.probe``); one that holds cached, partial or stale
weights does not.

The chain carries the file like ``config.json``: into full and delta snapshots (covered by
``posttrain.checksums.json``) and out again into a rebuilt folder. A folder without one (another
producer's, an older chain) is served as before. The file is canonical JSON (``probe_bytes``)::

    {"completions": [[int, ...], ...], "dtype": "float32" | "bfloat16" | "float16",
     "format": "posttrain-probe-v1", "logprobs": [[float, ...], ...], "prompts": [[int, ...], ...],
     "vocab_size": int}

``prompts``, ``completions`` and ``logprobs`` have one entry per prompt; ``completions[i]`` and
``logprobs[i]`` have the same length. Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from posttrain.chain.errors import ChainError, ChecksumMismatch
from posttrain.chain.format import PROBE_NAME
from posttrain.chain.manifest import MANIFEST_NAME, load_manifest
from posttrain.errors import validation_problems
from posttrain.fsutil import atomic_write

PROBE_FORMAT = "posttrain-probe-v1"
PROBE_PROMPTS = 4
PROBE_PROMPT_TOKENS = 8
PROBE_COMPLETION_TOKENS = 8
DTYPES = ("float32", "bfloat16", "float16")


def probe_prompts(vocab_size: int, n: int = PROBE_PROMPTS, length: int = PROBE_PROMPT_TOKENS) -> list[list[int]]:
    """``n`` fixed prompts of ``length`` token ids below ``vocab_size``: a function of those alone.

    Spread over the whole vocabulary by a multiplicative hash (Knuth's constant), so they hit
    ordinary tokens, special ones and the rarely trained tail alike.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size {vocab_size}: a probe needs a vocabulary of at least 2 tokens")
    return [[(2654435761 * (i * length + j + 1) + 40503 * i) % vocab_size for j in range(length)]
            for i in range(n)]


class Probe(BaseModel):
    """The expected answers of a model version to the probe prompts (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["posttrain-probe-v1"] = Field(PROBE_FORMAT, description="File format version.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="Dtype of the weights it was computed on.")
    vocab_size: int = Field(ge=2, description="The vocabulary size the prompts were derived from.")
    prompts: list[list[int]] = Field(min_length=1, description="Token ids of each prompt.")
    completions: list[list[int]] = Field(description="Greedy completion token ids of each prompt.")
    logprobs: list[list[float]] = Field(description="Logprob of each completion token (teacher-forced).")

    @model_validator(mode="after")
    def _shapes(self) -> Probe:
        if not (len(self.prompts) == len(self.completions) == len(self.logprobs)):
            raise ValueError(f"{len(self.prompts)} prompts, {len(self.completions)} completions and "
                             f"{len(self.logprobs)} logprob lists: one of each per prompt")
        for i, (p, c, lp) in enumerate(zip(self.prompts, self.completions, self.logprobs, strict=True)):
            if not p or not c:
                raise ValueError(f"prompt {i}: empty prompt or completion")
            if len(c) != len(lp):
                raise ValueError(f"prompt {i}: {len(c)} completion tokens but {len(lp)} logprobs")
            if any(t < 0 or t >= self.vocab_size for t in p + c):
                raise ValueError(f"prompt {i}: a token id outside the vocabulary of {self.vocab_size}")
            if any(not math.isfinite(x) or x > 1e-3 for x in lp):  # a log-softmax is <= 0, up to rounding
                raise ValueError(f"prompt {i}: logprobs must be finite and <= 0")
        return self

    def sequences(self) -> list[tuple[list[int], int]]:
        """For each prompt, ``prompt + expected completion`` (what an engine scores with prompt
        logprobs) and the index where the completion starts."""
        return [(list(p) + list(c), len(p)) for p, c in zip(self.prompts, self.completions, strict=True)]


def probe_bytes(probe: Probe) -> bytes:
    """The canonical file bytes: sorted keys, one-space indent, a final newline."""
    return (json.dumps(probe.model_dump(mode="json"), indent=1, sort_keys=True) + "\n").encode()


def write_probe(folder: str | os.PathLike[str], probe: Probe) -> Path:
    """Write ``<folder>/posttrain.probe.json`` atomically and durably."""
    return atomic_write(Path(folder) / PROBE_NAME, probe_bytes(probe))


def parse_probe(raw: bytes, where: str | os.PathLike[str]) -> Probe:
    """A probe from its file bytes; ValueError naming ``where`` and what is wrong."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: not a probe file (not JSON: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a probe file (not a JSON object)")
    try:
        return Probe.model_validate(obj)
    except ValidationError as e:
        problems = "; ".join(validation_problems(e)[:3])
        raise ValueError(f"{where}: not a valid probe ({problems})") from None


def read_probe(folder: str | os.PathLike[str]) -> Probe | None:
    """The folder's probe; None when it has none; ValueError naming the file when it is malformed."""
    path = Path(folder) / PROBE_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_probe(raw, path)


def copy_probe(checkpoint: Path, dest: Path) -> dict[str, int]:
    """Encoding: the checkpoint's probe, checked and copied byte for byte into the snapshot folder
    ``dest`` ({file name: bytes}); nothing when it has none. Readers of the format ignore the file."""
    src = checkpoint / PROBE_NAME
    try:
        raw = src.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        parse_probe(raw, src)
    except ValueError as e:
        raise ChainError(f"{e}; a snapshot carries only a valid probe") from None
    atomic_write(dest / PROBE_NAME, raw)
    return {PROBE_NAME: len(raw)}


def copy_target_probe(snapshot: Path, out: Path) -> None:
    """Reconstruction: the target snapshot's probe into the rebuilt folder ``out``, its bytes checked
    against the snapshot's checksums file when it has one; nothing when the snapshot has no probe."""
    try:
        raw = (snapshot / PROBE_NAME).read_bytes()
    except FileNotFoundError:
        return
    manifest = load_manifest(snapshot)
    if manifest is not None:
        if PROBE_NAME not in manifest.files:
            raise ChecksumMismatch(f"{manifest.label}: file {PROBE_NAME} is not in its {MANIFEST_NAME}; "
                                   f"{manifest.where(PROBE_NAME)}")
        manifest.check_bytes(PROBE_NAME, raw)
    atomic_write(out / PROBE_NAME, raw)
