"""The Prefect UI as a person sees it, in headless Chromium (over the DevTools protocol): a
deployment's Custom run form renders every parameter's description, shows the deployment's value in
each block field and sends exactly those values when submitted untouched; the GRPO rounds table
shows all its columns in a 1400 px window.

Against the tests' Prefect server when it serves its UI (scripts/test.sh starts it so), with the
deployments of prefect.yaml (the ``deployed`` fixture); otherwise against a server with its UI that
this module starts on a free port (SQLite) and deploys to, and stops. Everything goes through the
server's REST API and the browser, so both servers are driven alike."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from posttrain.pipeline.settings import BLOCK_PARAMETERS
from posttrain.pipeline.tasks.report import round_table_rows
from tests.pipeline.browser import Browser, chromium_path
from tests.pipeline.conftest import GRPO, REPO, SCRIPTS

pytestmark = pytest.mark.slow

K8S = "nightly-post-training/nightly-k8s"  # its cluster differs from the schema's default
NO_CHROMIUM = "needs Chromium to render the Prefect UI (apt-get install chromium fonts-dejavu-core)"
REQUIRED = os.environ.get("POSTTRAIN_REQUIRE_SERVICES") == "1"

if chromium_path() is None and not REQUIRED:  # at collection: no Prefect server started for nothing
    pytest.skip(NO_CHROMIUM, allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def chromium() -> None:
    if chromium_path() is None:
        pytest.fail(f"POSTTRAIN_REQUIRE_SERVICES=1 but this {NO_CHROMIUM}", pytrace=False)


@dataclass
class UI:
    url: str  # the UI's root
    api: str

    def call(self, method: str, path: str, body: object = None) -> object:
        request = urllib.request.Request(f"{self.api}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            data = r.read()
        return json.loads(data) if data else None

    def deployment(self, name: str) -> dict:
        return self.call("GET", f"/deployments/name/{name}")


def _serves_ui(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/", timeout=5) as r:
            return "text/html" in r.headers.get("Content-Type", "")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], env: dict, what: str, timeout: float = 180) -> None:
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout}{done.stderr}"


@pytest.fixture(scope="module")
def ui(request: pytest.FixtureRequest, prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UI]:
    served = prefect_api.removesuffix("/api")
    if _serves_ui(served):
        request.getfixturevalue("deployed")
        yield UI(served, prefect_api)
        return
    # The tests' server has no UI: one of our own, set up as a user would (prefect-setup, the default
    # blocks, prefect deploy --all from prefect.yaml).
    root = tmp_path_factory.mktemp("ui")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_PORT": str(port), "PREFECT_UI": "1", "POSTTRAIN_PREFECT_DIR": str(root / "prefect"),
           "POSTTRAIN_BIN_DIR": str(Path(sys.executable).parent), "PREFECT_API_URL": api, "PWD": str(REPO),
           "POSTTRAIN_BASE_MODEL": str(root / "model"), "POSTTRAIN_DATASET": str(root / "prompts.jsonl"),
           "POSTTRAIN_SHARED_DIR": str(root / "shared"), "POSTTRAIN_IMAGE": "posttrain:ui-test",
           "POSTTRAIN_PVC": "shared"}
    try:
        _run(["bash", str(SCRIPTS / "start-prefect.sh")], env, "start-prefect.sh")
        _run([sys.executable, "-m", "posttrain", "prefect-setup"], env, "posttrain prefect-setup")
        _run([sys.executable, "-c", "import sys; from posttrain.pipeline.deployments.embedded import "
              "save_default_blocks as s; s(store_dir=sys.argv[1], server_url='http://127.0.0.1:9', "
              "deployment_id='ui-test', model='tiny', token='t')", str(root / "store")], env, "saving the blocks")
        _run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], env, "prefect deploy --all")
        yield UI(api.removesuffix("/api"), api)
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop-prefect.sh")], env=env, capture_output=True, timeout=120)


# Each parameter of the form: its label, rendered description, the anyOf tab shown and the value in
# its input (a text box's text, or the option a block picker shows).
FIELDS = """Object.fromEntries([...document.querySelectorAll('.schema-form-property')]
  .filter(e => e.querySelector('.schema-form-property__label'))
  .map(e => {
    const label = e.querySelector('.schema-form-property__label').innerText.replace(/ \\(Optional\\)$/, '');
    const desc = e.querySelector('.schema-form-property__description');
    const tab = e.querySelector('.p-label__body > .p-button-group button[aria-selected=true]');
    const text = e.querySelector('.p-label__body textarea, .p-label__body input');
    const select = e.querySelector('.p-label__body select');
    const value = text ? text.value : select ? (select.selectedOptions[0] || {}).innerText : null;
    return [label, {description: desc && desc.innerText, tab: tab && tab.innerText, value}];
  }))"""


def _plain(markdown: str) -> str:
    """What a one-line markdown description reads as: code spans as their text."""
    return " ".join(markdown.replace("`", "").split())


def _form(browser: Browser, ui: UI, deployment: dict) -> dict:
    browser.open(f"{ui.url}/deployments/deployment/{deployment['id']}/run")
    blocks = " && ".join(f"f[{name!r}] && f[{name!r}].tab" for name in BLOCK_PARAMETERS)
    browser.wait_for(f"(() => {{ const f = {FIELDS}; return {blocks}; }})()", timeout=30)
    # The any-of fields pick their tab, and the last fields render their descriptions, asynchronously
    # (seen under load: an empty description at the end of the form): read until two reads agree.
    fields, deadline = browser.js(FIELDS), time.monotonic() + 10
    while True:
        time.sleep(0.5)
        again = browser.js(FIELDS)
        if again == fields and all(f["description"] != "" for f in fields.values()) or time.monotonic() > deadline:
            return again
        fields = again


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [GRPO, K8S])
def test_the_custom_run_form_shows_and_sends_the_deployments_block_values(ui, name, tmp_path):
    deployment = ui.deployment(name)
    given = deployment["parameters"]
    created = None
    with Browser() as browser:
        fields = _form(browser, ui, deployment)
        browser.screenshot(str(tmp_path / "form.png"))
        # Every description reads as written (a "<...>" in one was dropped as HTML).
        schema = deployment["parameter_openapi_schema"]["properties"]
        rendered = {k: f["description"] for k, f in fields.items()}
        assert rendered == {k: _plain(p["description"]) for k, p in schema.items() if p.get("description")}
        # Each block field shows the deployment's value, on the tab of a name given as text (not a
        # block picker showing "None").
        assert {k: fields[k]["value"] for k in BLOCK_PARAMETERS} == {k: given[k] for k in BLOCK_PARAMETERS}, fields
        assert {fields[k]["tab"] for k in BLOCK_PARAMETERS} == {"by name"}

        # Submitted untouched, the form sends the deployment's values.
        browser.intercept("*/create_flow_run")
        browser.js("[...document.querySelectorAll('button')].find(b => b.innerText.trim() == 'Submit').click()")
        held = browser.held_request()
        body = json.loads(held["request"]["postData"])
        assert {k: body["parameters"].get(k) for k in given} == given
        # The run is created (the server checks the parameters against the schema) as the form asked,
        # only scheduled a year ahead, so no worker of the tests' server picks it up.
        body["state"]["state_details"]["scheduled_time"] = (datetime.now(UTC) + timedelta(days=365)).isoformat()
        browser.resume(held["requestId"], json.dumps(body))
        try:
            deadline = time.monotonic() + 20
            while created is None:
                found = ui.call("POST", "/flow_runs/filter", {"flow_runs": {"name": {"any_": [body["name"]]}}})
                created = found[0] if found else None
                assert created or time.monotonic() < deadline, "the form's flow run was not created"
                time.sleep(0.3)
            assert created["deployment_id"] == deployment["id"]
            assert {k: created["parameters"][k] for k in BLOCK_PARAMETERS} == {k: given[k] for k in BLOCK_PARAMETERS}
        finally:
            if created is not None:
                ui.call("DELETE", f"/flow_runs/{created['id']}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["synchronous", "asynchronous"])
def test_the_rounds_table_shows_every_column_at_1400_px(ui, tmp_path, asynchronous):
    rows = [{"round": r, "policy version": r, "samples": 128, "reward mean": -0.4375, "reward std": 0.4961,
             "shard spread": 0.0625, "snapshot": f"step-{r:08d}-{'9f2c41d0' * 4}", "kind": "delta" if r else "full",
             "delta % of full": "12.34" if r else "full", "publish s": 123.45, "hot-load s": 12.34,
             "staleness": 1234, "wait s": 1234.56, "round s": 1234.56} for r in range(1000, 1003)]
    rows = round_table_rows(rows, asynchronous)
    artifact = ui.call("POST", "/artifacts/", {"key": "ui-test-rounds", "type": "table",
                                               "data": json.dumps(rows), "description": "rounds"})
    try:
        with Browser(width=1400, height=900) as browser:
            browser.open(f"{ui.url}/artifacts/artifact/{artifact['id']}")
            browser.wait_for("document.querySelectorAll('table th').length > 0", timeout=30)
            time.sleep(0.5)
            browser.screenshot(str(tmp_path / "rounds.png"), full_page=False)
            seen = browser.js("""(() => { const t = document.querySelector('table');
              return {headers: [...t.querySelectorAll('th')].map(th => th.innerText.trim()),
                      width: t.scrollWidth, shown: t.parentElement.clientWidth,
                      right: Math.max(...[...t.querySelectorAll('th')].map(th => th.getBoundingClientRect().right)),
                      window: window.innerWidth}; })()""")
    finally:
        ui.call("DELETE", f"/artifacts/{artifact['id']}")
    assert seen["headers"] == list(rows[0])
    assert seen["width"] <= seen["shown"] and seen["right"] <= seen["window"], seen
    assert re.fullmatch(r"[0-9a-f]{8}", rows[0]["snapshot"])
