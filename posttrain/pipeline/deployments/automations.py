"""``posttrain automations install FILE --block TYPE/NAME``: create an automation whose
notifications go to a named block.

The shipped files (``automations/``) hold a placeholder where the notification block's id goes,
and Prefect's ``prefect automation create --from-file`` accepts any UUID there: an automation
created with a made-up id is created, triggers, and notifies no one. So the placeholder is not a
UUID (Prefect's command refuses it), and this command fills the id from a block named the way
``prefect block ls`` names it, checking that the block exists and can notify.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import yaml

# What the shipped files hold instead of an id; also refused: the all-zero UUID they used to hold.
PLACEHOLDER = "SET-BY-posttrain-automations-install"
NULL_ID = "00000000-0000-0000-0000-000000000000"


class AutomationFileError(ValueError):
    """A bad automation file or block: one line naming the file, the action and the field."""


def read_automations(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The automations of a file as ``prefect automation create --from-file`` reads it: one, a list,
    or ``automations: [...]``."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise AutomationFileError(f"{path}: {' '.join(str(e).split())}") from None
    found = data["automations"] if isinstance(data, dict) and "automations" in data else data
    found = found if isinstance(found, list) else [found]
    if not found or not all(isinstance(a, dict) for a in found):
        raise AutomationFileError(f"{path}: expected an automation (name, trigger, actions) or a list of them")
    return found


def _blocked(value: Any) -> bool:
    """Whether a block_document_id is a placeholder rather than an id."""
    try:
        return str(uuid.UUID(str(value))) == NULL_ID
    except ValueError:
        return True


def fill_block_ids(path: str, automations: list[dict[str, Any]], block_id: str | None) -> list[dict[str, Any]]:
    """The automations with every action's ``block_document_id`` set to ``block_id``; without one,
    a placeholder left in the file is an error naming it."""
    out = []
    for a_index, automation in enumerate(automations):
        name = automation.get("name", f"automation {a_index}")
        actions = []
        for i, action in enumerate(automation.get("actions") or []):
            if isinstance(action, dict) and "block_document_id" in action:
                if block_id is not None:
                    action = {**action, "block_document_id": block_id}
                elif _blocked(action["block_document_id"]):
                    raise AutomationFileError(
                        f"{path}: {name}: actions[{i}].block_document_id is the placeholder "
                        f"{action['block_document_id']!r}, which notifies no one; pass --block <block type>/<name> "
                        "of a notification block (prefect block ls)")
            actions.append(action)
        out.append({**automation, "actions": actions})
    return out


def _notifies(doc, where: str, kind: str) -> None:
    capabilities = doc.block_schema.capabilities if doc.block_schema else []
    if "notify" not in capabilities:
        raise AutomationFileError(f"{where} cannot send notifications (a {kind} block); name a Slack, Microsoft "
                                  "Teams, custom webhook or other notification block")


def notification_block_id(ref: str) -> str:
    """The id of the block ``<block type>/<name>``; an error unless it exists and can notify."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    slug, _, name = ref.partition("/")
    if not slug or not name:
        raise AutomationFileError(f"--block: {ref!r} is not <block type>/<name> (prefect block ls)")
    with get_client(sync_client=True) as client:
        try:
            doc = client.read_block_document_by_name(name, slug, include_secrets=False)
        except ObjectNotFound:
            raise AutomationFileError(f"--block: no block {ref!r} on this server (prefect block ls)") from None
    _notifies(doc, f"--block: {ref!r}", slug)
    return str(doc.id)


def check_block_ids(path: str, automations: list[dict[str, Any]]) -> None:
    """Without ``--block``: every ``block_document_id`` of the file must be a block of this server that
    can notify. (Prefect creates an automation with any UUID there; it then notifies no one.)"""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for a_index, automation in enumerate(automations):
            name = automation.get("name", f"automation {a_index}")
            for i, action in enumerate(automation.get("actions") or []):
                if not (isinstance(action, dict) and "block_document_id" in action):
                    continue
                where = f"{path}: {name}: actions[{i}].block_document_id {action['block_document_id']}"
                try:
                    doc = client.read_block_document(uuid.UUID(str(action["block_document_id"])),
                                                     include_secrets=False)
                except (ObjectNotFound, ValueError):
                    raise AutomationFileError(
                        f"{where}: no block has this id on this server, so it would notify no one; pass --block "
                        "<block type>/<name> of a notification block (prefect block ls)") from None
                _notifies(doc, where, doc.block_type.slug if doc.block_type else "non-notification")


def _refusal(error) -> str:
    """The server's reason for refusing an automation, in one line: its first value error (a body
    that is not a valid template, ...), else the HTTP status."""
    try:
        detail = error.response.json().get("exception_detail")
    except Exception:  # noqa: BLE001 - a reply that is not JSON: the status says enough
        detail = None
    found = [d for d in detail if isinstance(d, dict) and d.get("type") == "value_error"] if isinstance(
        detail, list) else []
    status = f"HTTP {error.response.status_code}"
    if not found:
        return status
    loc = ".".join(str(p) for p in found[0].get("loc", ())[1:])  # without "body"
    return f"{status}: {loc}: {str(found[0].get('msg', '')).removeprefix('Value error, ')}"


def install(path: str, automations: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """Create each automation, replacing those of the same name (so installing again does not
    notify twice); returns (name, id, how many it replaced). The new ones are created first
    (paused): one the server refuses is an error naming it, the ones created for it are deleted
    and the automations installed before are left as they were. Then the old ones are deleted and
    the new ones resumed."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore
    from prefect.exceptions import PrefectHTTPStatusError
    from pydantic import ValidationError

    from posttrain import redact
    from posttrain.errors import describe_validation_error

    try:
        cores = [AutomationCore.model_validate(a) for a in automations]
    except ValidationError as e:
        raise AutomationFileError(f"{path}: {describe_validation_error(e)}") from None
    with get_client(sync_client=True) as client:
        created: list[tuple[AutomationCore, Any, list]] = []
        for core in cores:
            old = client.read_automations_by_name(core.name)
            try:
                created.append((core, client.create_automation(core.model_copy(update={"enabled": False})), old))
            except PrefectHTTPStatusError as e:
                for _, new_id, _ in created:
                    client.delete_automation(new_id)
                raise AutomationFileError(redact.scrub(
                    f"{path}: {core.name}: the Prefect server refused it ({_refusal(e)}); nothing was changed, "
                    "the automations installed before still run")) from None
        for core, new_id, old in created:
            for automation in old:
                client.delete_automation(automation.id)
            if core.enabled:
                client.resume_automation(new_id)
    return [(core.name, str(new_id), len(old)) for core, new_id, old in created]
