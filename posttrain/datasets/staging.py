"""Stage a conversational prompt dataset onto shared storage, content-addressed.

``stage_dataset(source, dest)`` reads a local JSONL or Parquet file whose rows hold ``prompt``
(a list of ``{role, content}`` text messages) plus optional extra columns (``answer``...,
handed to reward functions), validates every row, and writes
``<dest>/datasets/<sha256 prefix>/{data.jsonl,manifest.json}``. The digest is the SHA-256 of
the normalized ``data.jsonl`` bytes, so the same rows always land in the same folder and are
written once. The folder appears atomically (built under a temporary name, then renamed); when
any row is bad, nothing is staged and one error lists the problems by line or row number.

Pure Python (pyarrow is imported only for Parquet input).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.fsutil import atomic_open, atomic_write, publish_dir, staging_dir

DATA_FILE = "data.jsonl"
MANIFEST_FILE = "manifest.json"
DIGEST_PREFIX_CHARS = 16
MAX_REPORTED_PROBLEMS = 20
ROLES = ("system", "user", "assistant")

SourceFormat = Literal["jsonl", "parquet"]
_SUFFIX_FORMATS: dict[str, SourceFormat] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}


class StagingError(ValueError):
    """The source cannot be staged. ``problems`` lists every fault found (file, line, column)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


class DatasetManifest(BaseModel):
    """What ``manifest.json`` of a staged dataset records."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = Field(1, description="Layout version of the staged folder.")
    digest: str = Field(description="SHA-256 (hex) of the normalized data file's bytes.")
    rows: int = Field(ge=1, description="Number of rows in the data file.")
    columns: list[str] = Field(description="Column names of every row, 'prompt' first, then sorted.")
    source: str = Field(description="Absolute path of the file the rows were first staged from.")
    data_file: str = Field(DATA_FILE, description="Name of the JSONL data file next to the manifest.")
    created: datetime = Field(description="When the dataset was first staged (UTC).")


class StagedDataset(BaseModel):
    """Where a staged dataset lives, and whether this call wrote it."""

    model_config = ConfigDict(extra="forbid")

    manifest: DatasetManifest = Field(description="The manifest of the staged dataset.")
    manifest_path: Path = Field(description="Absolute path of manifest.json.")
    data_path: Path = Field(description="Absolute path of the normalized data.jsonl.")
    already_staged: bool = Field(description="True when the same digest was staged before; nothing was copied.")


def stage_dataset(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    source_format: SourceFormat | None = None,
) -> StagedDataset:
    """Validate ``source`` and stage it under ``<dest>/datasets/<digest prefix>/``.

    ``source_format`` defaults from the file suffix (.jsonl/.ndjson, .parquet/.pq).
    Raises StagingError, listing up to MAX_REPORTED_PROBLEMS bad rows, before anything is staged.
    """
    source = Path(source).expanduser().resolve()
    dest = Path(dest)
    if not dest.is_absolute():
        raise StagingError(f"dest {str(dest)!r}: must be an absolute path on shared storage")
    if dest.exists() and not dest.is_dir():
        raise StagingError(f"dest {dest}: is a file, not a folder")
    if not source.is_file():
        raise StagingError(f"{source}: no such file")
    fmt = source_format or _SUFFIX_FORMATS.get(source.suffix.lower())
    if fmt is None:
        raise StagingError(
            f"{source}: unknown file type {source.suffix!r}; use .jsonl/.ndjson or .parquet/.pq (or pass source_format)"
        )

    # First pass: validate and hash without writing, so bad or already staged data costs no writes.
    try:
        digest, rows, columns = _normalized_rows(source, fmt, out=None)
    except OSError as e:
        raise StagingError(f"{source}: cannot be read ({e.strerror or e})") from None
    final = dest / "datasets" / digest[:DIGEST_PREFIX_CHARS]
    if (final / MANIFEST_FILE).exists():
        return _existing(final, digest)
    try:
        return _write(source, fmt, final, digest, rows, columns)
    except OSError as e:
        raise StagingError(f"dest {dest}: cannot write the dataset there ({e.strerror or e}"
                           f"{': ' + e.filename if isinstance(e.filename, str) else ''})") from None


def _write(source: Path, fmt: SourceFormat, final: Path, digest: str, rows: int, columns: list[str]) -> StagedDataset:
    with staging_dir(final) as tmp:
        if _normalized_rows(source, fmt, out=tmp / DATA_FILE)[0] != digest:
            raise StagingError(f"{source}: changed while it was being staged; nothing staged")
        manifest = DatasetManifest(
            digest=digest, rows=rows, columns=columns, source=str(source), created=datetime.now(UTC)
        )
        atomic_write(tmp / MANIFEST_FILE, manifest.model_dump_json(indent=2) + "\n")
        try:
            publish_dir(tmp, final)
        except FileExistsError:
            if (final / MANIFEST_FILE).exists():  # a concurrent stager of the same data won the race
                return _existing(final, digest)
            raise StagingError(f"{final}: exists without a {MANIFEST_FILE}; remove it and stage again") from None
    return StagedDataset(
        manifest=manifest,
        manifest_path=final / MANIFEST_FILE,
        data_path=final / DATA_FILE,
        already_staged=False,
    )


def load_manifest(manifest_path: str | os.PathLike[str]) -> DatasetManifest:
    """Read and validate a staged dataset's manifest.json."""
    path = Path(manifest_path)
    try:
        return DatasetManifest.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise StagingError(f"{path}: no such manifest") from None
    except ValidationError as e:
        raise StagingError(f"{path}: not a valid dataset manifest: {e}") from None


def read_staged_rows(manifest_path: str | os.PathLike[str], *, verify: bool = True) -> list[dict[str, Any]]:
    """The rows of a staged dataset. With ``verify``, the data file must match the manifest digest."""
    manifest_path = Path(manifest_path)
    manifest = load_manifest(manifest_path)
    data_path = manifest_path.parent / manifest.data_file
    data = data_path.read_bytes()
    if verify and hashlib.sha256(data).hexdigest() != manifest.digest:
        raise StagingError(f"{data_path}: contents do not match the digest in {manifest_path}")
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def _existing(folder: Path, digest: str) -> StagedDataset:
    manifest_path = folder / MANIFEST_FILE
    manifest = load_manifest(manifest_path)
    if manifest.digest != digest:
        raise StagingError(f"{manifest_path}: records digest {manifest.digest}, expected {digest}")
    return StagedDataset(
        manifest=manifest,
        manifest_path=manifest_path,
        data_path=folder / manifest.data_file,
        already_staged=True,
    )


def _normalized_rows(source: Path, fmt: SourceFormat, out: Path | None) -> tuple[str, int, list[str]]:
    """Validate every row and hash the normalized lines, writing them to ``out`` when given.

    Returns (digest, rows, columns); raises StagingError listing the problems.
    """
    problems: list[str] = []
    digest = hashlib.sha256()
    rows = 0
    columns: list[str] | None = None
    with atomic_open(out, "wb") if out is not None else contextlib.nullcontext() as f:
        for where, row in _read_rows(source, fmt):
            if isinstance(row, Exception):
                problems.append(f"{where}: {row}")
                continue
            line, row_problems = _normalize_row(row, columns)
            if row_problems:
                problems += [f"{where}: {p}" for p in row_problems]
                continue
            if columns is None:
                columns = _column_order(row)
            data = line.encode("utf-8") + b"\n"
            digest.update(data)
            if f is not None:
                f.write(data)
            rows += 1
    if not problems and rows == 0:
        problems.append("no rows")
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        listing = "\n".join(f"  - {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
        raise StagingError(f"{source}: {len(problems)} problem(s), nothing staged:\n{listing}", problems)
    assert columns is not None
    return digest.hexdigest(), rows, columns


def _read_rows(source: Path, fmt: SourceFormat) -> Iterator[tuple[str, Any]]:
    """(location, row or parse error) for every row; locations count from 1."""
    if fmt == "jsonl":
        with open(source, "rb") as f:  # bytes, decoded line by line: an error names its own line
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8", errors="strict")
                except UnicodeDecodeError as e:
                    yield f"line {lineno}", ValueError(f"not UTF-8 ({e.reason} at byte {e.start + 1} of the line)")
                    continue
                if line.strip():
                    yield f"line {lineno}", _json_row(line)
    else:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(source)
            row_no = 0
            for batch in parquet.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    row_no += 1
                    yield f"row {row_no}", row
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise StagingError(f"{source}: cannot read as Parquet ({e})") from None


def _json_row(line: str) -> Any:
    """The parsed line, or the ValueError saying why it is not a row."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        return ValueError(f"not valid JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return ValueError("cannot be read: JSON nested too deeply")
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        return ValueError(f"cannot be read: {str(e).split(';')[0]}")


def _column_order(row: dict[str, Any]) -> list[str]:
    return ["prompt"] + sorted(k for k in row if k != "prompt")


def _normalize_row(row: Any, columns: list[str] | None) -> tuple[str, list[str]]:
    """The row as one canonical JSON line, or the problems that stop it from being staged."""
    if not isinstance(row, dict):
        return "", [f"expected a JSON object, got {type(row).__name__}"]
    problems = []
    if "prompt" not in row:
        problems.append("missing column 'prompt'")
    else:
        problems += _prompt_problems(row["prompt"])
    if columns is not None:
        missing = [c for c in columns if c not in row]
        extra = sorted(k for k in row if k not in columns)
        if missing:
            problems.append(f"missing column(s) {missing} that the first good row has")
        if extra:
            problems.append(f"column(s) {extra} that the first good row does not have")
    if problems:
        return "", problems
    normalized = {"prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]}
    for key in sorted(k for k in row if k != "prompt"):
        try:
            json.dumps(row[key], allow_nan=False)
        except ValueError:
            problems.append(f"column {key!r}: NaN and Infinity cannot be stored as JSON")
        except TypeError as e:
            problems.append(f"column {key!r}: value cannot be stored as JSON ({e})")
        normalized[key] = row[key]
    if problems:
        return "", problems
    return json.dumps(normalized, ensure_ascii=False, separators=(",", ":"), allow_nan=False), []


def _prompt_problems(prompt: Any) -> list[str]:
    if not isinstance(prompt, list) or not prompt:
        return ["column 'prompt': must be a non-empty list of {role, content} messages"]
    problems = []
    for i, message in enumerate(prompt, start=1):
        where = f"prompt message {i}"
        if not isinstance(message, dict):
            problems.append(f"{where}: expected an object with 'role' and 'content'")
            continue
        # Parquet structs carry every field of the schema, so a None-valued extra key counts as absent.
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
        if extra:
            problems.append(f"{where}: unexpected key(s) {extra}; only 'role' and 'content' are allowed")
        role = message.get("role")
        if role not in ROLES:
            problems.append(f"{where}: role must be one of {list(ROLES)}, got {role!r}")
        content = message.get("content")
        if not isinstance(content, str):
            problems.append(f"{where}: content must be text, got {type(content).__name__}")
    return problems
