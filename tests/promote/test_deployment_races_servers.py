"""Promotion, rollback and gc racing end to end: two real reference servers (staging and
production) on one folder store, and each operation a process of its own (tests/support/server_race.py):
the promotion engine evaluating on staging, ``posttrain rollback --to previous`` against
production's hot-load API, and ``posttrain gc --keep-runs 1``.

The store holds two runs of the tiny models: night-0 (older; m0, m1, m2) and night-1 (m0, m1). The
history's champions are night-1's m0 then m1 (production serves m1); the candidate is night-0's
m2 (better on the eval set, whose references are m2's answers, and in the run gc deletes unless a
record names it). After each race, docs/promotion.md's invariant ("One writer per deployment"):
what production serves, read back from the production server (its replicas' identity and its
answers), is the history's champion; each operation completed with its record or lost in one line
with nothing recorded; whatever a record names is in the store with its chain; no run recorded twice."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
from posttrain.promote.history import History, Record
from posttrain.promote.lease import lease_key
from posttrain.promote.promoter import describe_snapshot, load_version
from posttrain.storage import LocalStore
from tests.support.chains import Nightly, publish_run, snapshots_in
from tests.support.deployment_race import decision, start
from tests.support.promotion import eval_rows, served_identities
from tests.support.server_race import promote_worker, start_cli
from tests.support.serving import TOKEN, Api, start_server

pytestmark = pytest.mark.timeout(300)

RUN = "nightly-race"  # the promotion's flow run


@dataclass(frozen=True)
class Case:
    starts: dict[str, float]  # operation -> seconds after the start
    later: tuple[str, ...] = ()  # operations started once ``when`` holds
    when: str = ""
    faults: dict[str, list[dict]] = field(default_factory=dict)  # server -> faults of its next hot-loads


CASES = {
    # the rollback is recorded while the gate evaluates (staging's first hot-load is slow); gc once
    # the promotion has ended (before, it would delete the candidate and leave nothing to switch to)
    "rollback-during-the-evals": Case({"promote": 0.0, "rollback": 0.0}, ("gc",), "the promotion ended",
                                      {"staging": [{"kind": "delay_hotload", "seconds": 3.0}]}),
    # gc plans and deletes the candidate's run while the other two start
    "gc-first": Case({"gc": 0.0, "promote": 0.3, "rollback": 0.6}),
    # rollback and gc start while production is being switched to the candidate (a slow hot-load)
    "during-the-switch": Case({"promote": 0.0}, ("rollback", "gc"), "production loads the candidate",
                              {"prod": [{"kind": "delay_hotload", "seconds": 4.0}]}),
}


@dataclass
class Site:
    root: Path  # the folder store
    done: Nightly
    urls: dict[str, str]
    history: History
    first: str  # night-1's m0 and m1: the champions, production serving m1
    champion: str
    candidate: str  # night-0's m2


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def published(chain, tmp_path_factory) -> tuple[Path, Nightly]:
    root = tmp_path_factory.mktemp("race")
    done = publish_run(LocalStore(root / "store"), root, "night-0", chain.models)
    publish_run(LocalStore(root / "store"), root, "night-1", chain.models[:2], done)
    return root / "store", done


@pytest.fixture(scope="module")
def rows(chain) -> list[dict]:
    return eval_rows(chain.models)  # references: m2's greedy answers


@pytest.fixture
def site(chain, published, tmp_path) -> Site:
    template, done = published
    root = tmp_path / "store"
    shutil.copytree(template, root, symlinks=True)
    store = LocalStore(root)
    first, champion = done.identities("night-1")
    history = History(store, "", "prod")
    for run, identity, previous in (("nightly-0", first, None), ("nightly-1", champion, first)):
        history.append(Record(kind="promotion", deployment="prod", identity=identity, previous=previous, run=run,
                              decision=decision(identity, previous, True), reason="accepted: test"))
    servers = [start_server(chain, tmp_path / name, root, deployment_id=name, prefix="") for name in ("staging", "prod")]
    urls = {"staging": servers[0].url, "prod": servers[1].url}
    try:
        with CoreWeaveHotLoader(HotLoadConfig(api_url=urls["prod"], deployment_id="prod", token=TOKEN,
                                              poll_interval=0.05, timeout=60)) as loader:
            load_version(loader, store, champion)
        yield Site(root, done, urls, history, first, champion, done.identities("night-0")[-1])
    finally:
        for s in servers:
            s.shutdown()


@pytest.fixture
def reap():
    """Processes a test started; any still running at its end (a failed test) are killed."""
    started: list = []
    yield started
    for proc in started:
        if isinstance(proc, subprocess.Popen) and proc.poll() is None:
            proc.kill()
        elif not isinstance(proc, subprocess.Popen) and proc.is_alive():
            proc.kill()


def loading(api: Api, identity: str) -> bool:
    r = api.get("/v1alpha1/inference/hotLoads", params={"parentDeploymentId": "prod", "maxPageSize": 1000})
    return any(op["spec"]["identity"] == identity for op in r.json()["hotLoads"])


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def chain_of(store: LocalStore, identity: str) -> list[str]:
    """``identity`` and the snapshots it is rebuilt from, as the store describes them."""
    out = [identity]
    while (base := describe_snapshot(store, out[-1])[1]) is not None:
        out.append(base)
    return out


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_promote_rollback_and_gc_race_with_two_reference_servers(chain, site, rows, tmp_path, case, reap):
    apis = {name: Api(url) for name, url in site.urls.items()}
    for name, faults in case.faults.items():
        apis[name].faults(*faults)
    go = {op: tmp_path / f"go-{op}" for op in ("promote", "rollback", "gc")}
    delay = {op: case.starts.get(op, 0.0) for op in go}
    out_p = tmp_path / "promote.json"
    promotion = start(promote_worker, str(site.root), site.candidate, RUN, site.urls, str(chain.models[0]), rows,
                      str(out_p), str(go["promote"]), delay["promote"])
    rollback = start_cli(["rollback", "--store", str(site.root), "--deployment", "prod", "--api-url", site.urls["prod"],
                          "--to", "previous", "--poll-interval", "0.05", "--timeout", "120"],
                         tmp_path / "rollback", go["rollback"], delay["rollback"])
    gc = start_cli(["gc", "--store", str(site.root), "--keep-runs", "1"], tmp_path / "gc", go["gc"], delay["gc"])
    reap += [promotion, rollback.proc, gc.proc]
    ready = [out_p.with_suffix(".ready"), rollback.ready, gc.ready]
    wait_for(lambda: all(r.exists() for r in ready), "every operation to import what it needs")
    for op in case.starts:
        go[op].touch()
    conditions = {"the promotion ended": lambda: not promotion.is_alive(),
                  "production loads the candidate": lambda: loading(apis["prod"], site.candidate)
                  or not promotion.is_alive()}
    if case.later:
        wait_for(conditions[case.when], case.when)
        for op in case.later:
            go[op].touch()

    promotion.join(180)
    assert promotion.exitcode == 0, f"the promotion's process: exit code {promotion.exitcode}"
    promoted = json.loads(out_p.read_text())
    rolled, collected = rollback.result(), gc.result()
    records = site.history.records()
    summary = (f"promotion: {promoted}\nrollback: {rolled}\ngc: {collected}\n"
               f"records: {[(r.seq, r.kind, r.identity, r.run) for r in records]}")

    # production's served identity, read back from the production server, is the history's champion
    champion = site.history.champion()
    assert served_identities(apis["prod"], "prod") == {champion}, summary
    assert apis["prod"].greedy() == chain.greedy[chain.models.index(site.done.checkpoints[champion])], summary

    # each operation completed with its record, or lost in one line and recorded nothing
    new = records[2:]
    mine = [r for r in new if r.run == RUN]
    rollbacks = [r for r in new if r.kind == "rollback"]
    if promoted["ok"]:
        assert [(r.seq, r.kind) for r in mine] == [(promoted["seq"], promoted["kind"])], summary
    else:
        assert promoted["error"] in ("OperationLost", "PromotionError"), summary
        assert "\n" not in promoted["message"] and mine == [], summary
    rc, stdout, stderr = rolled
    if rc == 0:
        assert len(rollbacks) == 1 and f"recorded as #{rollbacks[0].seq} " in stdout, summary
    else:
        assert rc in (1, 2) and rollbacks == [], summary
        assert one_line(stderr).startswith("posttrain: error: ") and "Traceback" not in stderr, summary
    assert sorted(r.seq for r in new) == sorted(r.seq for r in mine + rollbacks), summary  # no reverted records
    assert collected[0] == 0, summary

    # whatever a record names (the refused candidate aside: gc does not keep it) is in the store, with its chain
    store = LocalStore(site.root)
    present = snapshots_in(store)
    for r in records:
        for identity in (None if r.kind == "refusal" else r.identity, r.previous):
            if identity is not None:
                assert identity in present and set(chain_of(store, identity)) <= present, summary
    # no run recorded twice; nobody holds production any more
    runs = [r.run for r in records if r.run is not None]
    assert len(runs) == len(set(runs)), summary
    assert not store.exists(lease_key("prod")), summary
