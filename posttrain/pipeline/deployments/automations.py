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
    capabilities = doc.block_schema.capabilities if doc.block_schema else []
    if "notify" not in capabilities:
        raise AutomationFileError(f"--block: {ref!r} cannot send notifications (a {slug} block); name a Slack, "
                                  "Microsoft Teams, custom webhook or other notification block")
    return str(doc.id)


def install(path: str, automations: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """Create each automation, replacing those of the same name (so installing again does not
    notify twice); returns (name, id, how many it replaced)."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore
    from pydantic import ValidationError

    from posttrain.errors import describe_validation_error

    try:
        cores = [AutomationCore.model_validate(a) for a in automations]
    except ValidationError as e:
        raise AutomationFileError(f"{path}: {describe_validation_error(e)}") from None
    done = []
    with get_client(sync_client=True) as client:
        for core in cores:
            old = client.read_automations_by_name(core.name)
            for automation in old:
                client.delete_automation(automation.id)
            done.append((core.name, str(client.create_automation(core)), len(old)))
    return done
