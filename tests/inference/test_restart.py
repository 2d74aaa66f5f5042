"""A restarted server resumes the version it served (recorded in its work dir), answers for its
earlier operations, keeps a bounded number of rebuilt folders, and a repeated hot-load succeeds."""

from __future__ import annotations

import json
import shutil

import pytest

from posttrain.inference.hotload import operation_id_for
from posttrain.inference.protocol import STATE_FAILED
from tests.support.serving import DEPLOYMENT, Api, start_server


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.shutdown()


def _start(chain, work, servers):
    server = start_server(chain, work)
    servers.append(server)
    return server, Api(server.url)


def test_a_restarted_server_resumes_and_a_repeated_hot_load_succeeds(chain, tmp_path, make_client, servers):
    work = tmp_path / "work"
    first, api = _start(chain, work, servers)
    assert api.get("/health").json()["boot"] == "clean"
    client = make_client(first)
    client.hot_load(chain.full)
    client.hot_load(chain.d1, base_identity=chain.full)
    assert len(list((work / "models").iterdir())) == 1  # the previous version's folder went
    first.shutdown()
    servers.remove(first)
    # what runs killed mid-load leave behind
    (work / "models" / "killed-rebuild").mkdir()
    (work / "views" / "killed-view").mkdir()

    second, api = _start(chain, work, servers)
    health = api.get("/health").json()
    assert (health["snapshotIdentity"], health["boot"]) == (chain.d1, "resumed")
    assert api.greedy() == chain.greedy[1]
    assert [p.name for p in (work / "models").iterdir()] == [f"{chain.d1}-{operation_id_for(DEPLOYMENT, chain.d1, 0)[:12]}"]
    assert list((work / "views").iterdir()) == []
    assert [o["spec"]["identity"] for o in api.ops()] == [chain.d1, chain.full]  # its history, newest first

    client = make_client(second)
    again = client.hot_load(chain.d1, base_identity=chain.full)  # the trainer's retry after the restart
    assert again.adopted and api.stats()["creates"] == {}
    client.hot_load(chain.d2, base_identity=chain.d1)  # a delta on the resumed version
    assert api.greedy() == chain.greedy[2]
    assert len(list((work / "models").iterdir())) == 1


def test_without_a_record_it_boots_clean_and_the_same_hot_load_runs_again(chain, tmp_path, make_client, servers):
    work = tmp_path / "work"
    first, _ = _start(chain, work, servers)
    make_client(first).hot_load(chain.full)
    first.shutdown()
    servers.remove(first)
    (work / "state.json").unlink()

    second, api = _start(chain, work, servers)
    health = api.get("/health").json()
    assert (health["snapshotIdentity"], health["boot"]) == (None, "clean")
    assert list((work / "models").iterdir()) == []  # an unrecorded rebuilt folder is not kept
    # the folder the earlier operation would rebuild into is there again (a run killed mid-rebuild)
    leftover = work / "models" / f"{chain.full}-{operation_id_for(DEPLOYMENT, chain.full, 0)[:12]}"
    shutil.copytree(chain.models[1], leftover)
    result = make_client(second).hot_load(chain.full)  # the same hotLoadId: no OutputExists
    assert result.operation_id == operation_id_for(DEPLOYMENT, chain.full, 0)
    assert api.greedy() == chain.greedy[0]


def test_an_operation_cut_short_by_a_restart_is_failed(chain, tmp_path, make_client, servers):
    work = tmp_path / "work"
    first, _ = _start(chain, work, servers)
    make_client(first).hot_load(chain.full)
    first.shutdown()
    servers.remove(first)
    state = json.loads((work / "state.json").read_text())
    state["operations"][0]["state"] = "HOT_LOAD_STATE_RUNNING"
    (work / "state.json").write_text(json.dumps(state))

    _, api = _start(chain, work, servers)
    (op,) = api.ops()
    assert op["status"]["state"] == STATE_FAILED
    assert op["status"]["conditions"][-1]["reason"] == "ServerRestarted"
    assert api.get("/health").json()["snapshotIdentity"] == chain.full


def test_an_unreadable_record_is_ignored(chain, tmp_path, servers):
    work = tmp_path / "work"
    work.mkdir()
    (work / "state.json").write_text('{"version": 1, "identity": "x\\n", "folder": "../../etc"}')
    _, api = _start(chain, work, servers)
    assert api.get("/health").json()["boot"] == "clean"
