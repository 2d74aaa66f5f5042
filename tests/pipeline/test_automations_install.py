"""``posttrain automations install FILE --block TYPE/NAME``: the shipped automation's notification
block is filled from a named block; left unfilled, it is refused by this command and by Prefect's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.pipeline.deployments.automations import (
    NULL_ID,
    AutomationFileError,
    fill_block_ids,
    read_automations,
)
from tests.pipeline.runs import prefect_cli

REPO = Path(__file__).resolve().parents[2]
AUTOMATION = REPO / "automations" / "hotload-failed.yaml"
NAME = "posttrain-hotload-failed"


def posttrain(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *args], cwd=REPO, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=180)


def test_the_shipped_placeholder_is_refused_naming_the_action():
    with pytest.raises(AutomationFileError) as info:
        fill_block_ids(str(AUTOMATION), read_automations(AUTOMATION), None)
    assert f"{NAME}: actions[0].block_document_id is the placeholder" in str(info.value)
    assert "--block <block type>/<name>" in str(info.value)


def test_the_all_zero_id_is_a_placeholder_too(tmp_path):
    spec = yaml.safe_load(AUTOMATION.read_text())
    spec["actions"][0]["block_document_id"] = NULL_ID
    with pytest.raises(AutomationFileError, match="is the placeholder"):
        fill_block_ids("f.yaml", [spec], None)
    filled = fill_block_ids("f.yaml", [spec], "0b0a3f47-5b2c-4a3e-9a53-2d2c1d3c4e5f")
    assert filled[0]["actions"][0]["block_document_id"] == "0b0a3f47-5b2c-4a3e-9a53-2d2c1d3c4e5f"


def test_install_without_block_is_one_line_before_any_server_is_asked():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    run = posttrain("automations", "install", str(AUTOMATION),
                    env={**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{dead}/api"})
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1
    assert "actions[0].block_document_id is the placeholder" in run.stderr


def test_prefect_itself_refuses_the_shipped_file_unfilled(prefect_api):
    from prefect import get_client

    created = prefect_cli("automation", "create", "--from-file", str(AUTOMATION))
    assert created.returncode != 0
    with get_client(sync_client=True) as client:
        assert client.read_automations_by_name(NAME) == []


def test_install_fills_the_notification_block_and_replaces_an_earlier_install(prefect_api):
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from posttrain.pipeline.blocks import LocalCluster

    block_id = CustomWebhookNotificationBlock(name="posttrain-install-test", url="http://127.0.0.1:9/notify").save(
        "posttrain-install-test", overwrite=True)
    LocalCluster().save("posttrain-install-test", overwrite=True)
    try:
        not_notify = posttrain("automations", "install", str(AUTOMATION),
                               "--block", "posttrain-local-cluster/posttrain-install-test")
        assert not_notify.returncode == 2 and "cannot send notifications" in not_notify.stderr
        missing = posttrain("automations", "install", str(AUTOMATION), "--block", "custom-webhook/no-such-block")
        assert missing.returncode == 2 and "no block 'custom-webhook/no-such-block'" in missing.stderr
        for _ in range(2):  # installing again replaces it: one automation, one notification per failure
            run = posttrain("automations", "install", str(AUTOMATION), "--block", "custom-webhook/posttrain-install-test")
            assert run.returncode == 0, run.stderr
        assert "replacing 1" in run.stdout
        with get_client(sync_client=True) as client:
            (automation,) = client.read_automations_by_name(NAME)
        assert automation.enabled
        assert automation.trigger.expect == {"posttrain.hotload.failed"}
        assert automation.trigger.match.root == {"posttrain.will-retry": "false"}
        (action,) = automation.actions
        assert action.type == "send-notification" and "{{ event.payload.error }}" in action.body
        assert str(action.block_document_id) == str(block_id)
    finally:
        with get_client(sync_client=True) as client:
            for left in client.read_automations_by_name(NAME):
                client.delete_automation(left.id)


@pytest.fixture
def webhook_block(prefect_api):
    """A notification block on the server (its id), and the automation's name cleaned up after."""
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block_id = CustomWebhookNotificationBlock(name="posttrain-install-test", url="http://127.0.0.1:9/notify").save(
        "posttrain-install-test", overwrite=True)
    try:
        yield str(block_id)
    finally:
        with get_client(sync_client=True) as client:
            for left in client.read_automations_by_name(NAME):
                client.delete_automation(left.id)


def _installed():
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_automations_by_name(NAME)


def test_an_id_in_the_file_must_be_a_notification_block_of_the_server(webhook_block, tmp_path):
    """Without --block, a UUID written in the file that names no block was installed as it was (Prefect
    accepts any UUID): an automation that notifies no one."""
    import uuid

    spec = yaml.safe_load(AUTOMATION.read_text())
    made_up = str(uuid.uuid4())
    spec["actions"][0]["block_document_id"] = made_up
    path = tmp_path / "made-up.yaml"
    path.write_text(yaml.safe_dump(spec))
    run = posttrain("automations", "install", str(path))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert f"actions[0].block_document_id {made_up}: no block has this id on this server" in run.stderr
    assert "--block" in run.stderr and _installed() == []
    spec["actions"][0]["block_document_id"] = webhook_block  # a real one is installed as it is
    path.write_text(yaml.safe_dump(spec))
    run = posttrain("automations", "install", str(path))
    assert run.returncode == 0, run.stderr
    (automation,) = _installed()
    assert str(automation.actions[0].block_document_id) == webhook_block and automation.enabled


def test_a_reinstall_the_server_refuses_leaves_the_working_automation(webhook_block, tmp_path):
    """The server refuses a notification body that is not a valid template (the client does not check
    it): the installed automation was deleted first, then the create raised (24-line traceback)."""
    run = posttrain("automations", "install", str(AUTOMATION), "--block", "custom-webhook/posttrain-install-test")
    assert run.returncode == 0, run.stderr
    (working,) = _installed()
    spec = yaml.safe_load(AUTOMATION.read_text())
    spec["actions"][0]["body"] = "{{ event.payload.error"  # an unclosed tag
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(spec))
    run = posttrain("automations", "install", str(path), "--block", "custom-webhook/posttrain-install-test")
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert f"{path}: {NAME}: the Prefect server refused it (HTTP 422" in run.stderr and "body" in run.stderr
    assert "nothing was changed" in run.stderr
    (still,) = _installed()
    assert still.id == working.id and still.enabled and still.actions[0].body == working.actions[0].body
