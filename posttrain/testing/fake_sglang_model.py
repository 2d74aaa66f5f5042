"""The model behind ``FakeSGLang``: a weights folder checked by safetensors headers, and replies
derived from (folder, version, prompt) so a test can tell which weights answered.

``check_update`` is how the fake judges ``/update_weights_from_disk`` (the failure messages of
SGLang's ``ModelRunner.update_weights_from_disk``, see ``docs/sglang-http-api.md``);
``one_output`` builds one ``/generate`` reply.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

VOCAB_SIZE = 32000
DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens default in SGLang
ROLLBACK = "\nRolling back to original weights."


def safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape over every ``*.safetensors`` file in ``folder`` (headers only)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = list(meta["shape"])
    return shapes


def check_update(path: str, current: dict[str, list[int]]) -> tuple[bool, str, dict[str, list[int]]]:
    """(success, SGLang's message, the new folder's shapes) for loading ``path`` over ``current``."""
    folder = Path(path)
    if not folder.is_dir():
        return False, f"Failed to get weights iterator: {path} (repository not found).", {}
    new = safetensors_shapes(folder)
    if not new:
        return False, f"Failed to get weights iterator: Cannot find any model weights with `{path}`.", {}
    for name, shape in new.items():
        if name not in current:
            return False, f"Failed to update weights: '{name}'.{ROLLBACK}", new
        if shape != current[name]:
            return False, (f"Failed to update weights: size mismatch for {name}: "
                           f"param {current[name]}, loaded {shape}.{ROLLBACK}"), new
    return True, "Succeeded to update model weights.", new


def validation_error(detail: str) -> tuple[int, Any]:
    """http_server.py validation_exception_handler: 400 with an OpenAI-style ErrorResponse."""
    return 400, {"object": "error", "message": detail, "type": "Bad Request", "param": None, "code": 400}


def one_output(
    rid: str, prompt: list[int], max_new: int, folder: str, version: str, logprobs: bool, aborted: bool
) -> dict[str, Any]:
    """One ``/generate`` reply: ``max_new`` tokens (none when ``aborted``) hashed from the weights."""
    n = 0 if aborted else max_new
    ids: list[int] = []
    lps: list[float] = []
    for i in range(n):
        digest = hashlib.sha256(f"{folder}|{version}|{prompt}|{i}".encode()).digest()
        ids.append(int.from_bytes(digest[:4], "little") % VOCAB_SIZE)
        lps.append(-int.from_bytes(digest[4:6], "little") / 8192.0)
    finish = (
        {"type": "abort", "message": "Abort before prefill"} if aborted else {"type": "length", "length": n}
    )
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "weight_version": version,
        "completion_tokens": n,
        "cached_tokens": 0,
        "e2e_latency": 0.0,
    }
    if logprobs:
        meta["input_token_logprobs"] = [[None, prompt[0], None]] + [[-1.0, t, None] for t in prompt[1:]]
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
    return {"text": " ".join(str(t) for t in ids), "output_ids": ids, "meta_info": meta}
