"""What a server remembers across a restart: ``<work_dir>/state.json``, written atomically.

It records the version served (the rebuilt folder under ``<work_dir>/models`` and its identity)
and the hot-load operations (the newest ``MAX_KEPT_OPERATIONS``). A restarted server reloads that
version, answers for the earlier operations, and marks those a restart cut short FAILED; without
a usable record it says plainly that it booted clean, on its boot weights.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import xxhash

from posttrain.chain.errors import FormatError
from posttrain.chain.format import check_identity
from posttrain.chain.manifest import MANIFEST_NAME, load_manifest
from posttrain.fsutil import atomic_write
from posttrain.serve.operations import Operation

log = logging.getLogger(__name__)

FOLDER_NAME_MAX = 200  # bytes of a rebuilt folder's name before its "-<operation id>" suffix
STATE_NAME = "state.json"
STATE_VERSION = 1
MAX_KEPT_OPERATIONS = 1000


@dataclass
class ServerState:
    identity: str | None = None  # the version served; None: the boot weights
    folder: str | None = None  # its folder's name under <work_dir>/models
    operations: list[Operation] = field(default_factory=list)


def save_state(work_dir: Path, state: ServerState) -> None:
    ops = sorted(state.operations, key=lambda o: o.seq)[-MAX_KEPT_OPERATIONS:]
    data = {"version": STATE_VERSION, "identity": state.identity, "folder": state.folder,
            "operations": [asdict(o) for o in ops]}
    atomic_write(work_dir / STATE_NAME, json.dumps(data, indent=1) + "\n")


def load_state(work_dir: Path) -> ServerState | None:
    """The recorded state, or None (with the reason logged) when there is none or it cannot be used."""
    path = work_dir / STATE_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s); ignoring it", path, e)
        return None
    try:
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} state file")
        identity, folder = data.get("identity"), data.get("folder")
        if identity is not None:
            check_identity(identity, "identity")
            if not isinstance(folder, str) or not folder or os.sep in folder or folder.startswith("."):
                raise ValueError(f"bad folder {folder!r}")
        names = {f.name for f in fields(Operation)}
        ops = [Operation(**{k: v for k, v in o.items() if k in names}) for o in data.get("operations") or []]
    except (ValueError, TypeError, AttributeError, FormatError) as e:
        log.warning("%s is not a state this server wrote (%s); ignoring it", path, e)
        return None
    return ServerState(identity, folder if identity is not None else None, ops)


def folder_name(identity: str) -> str:
    """A folder name for ``identity`` that leaves room for a suffix within the file system's 255 bytes
    (identities may be 255 characters): a long one keeps its start and a digest of the whole."""
    if len(identity.encode()) <= FOLDER_NAME_MAX:
        return identity
    return f"{identity.encode()[:FOLDER_NAME_MAX - 33].decode(errors='ignore')}-{xxhash.xxh3_128_hexdigest(identity.encode())}"


def verify_held(folder: Path) -> None:
    """Check a rebuilt folder before serving it again: every file and every tensor's bytes against its
    ``posttrain.checksums.json`` (a byte changed on disk since the rebuild is caught here)."""
    if not folder.is_dir():
        raise FormatError(f"{folder}: not a folder")
    manifest = load_manifest(folder)
    if manifest is None:
        raise FormatError(f"{folder}: no {MANIFEST_NAME} to check it against")
    manifest.check_all(deep=True)
