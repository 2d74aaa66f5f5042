"""The nightly flow's gc settings (flat parameters ``gc_keep_runs``, ``gc_keep_days``, ``gc_protect``)
and its last task, ``collect-garbage``, on a folder store: it keeps what the histories need, what
the run's inference deployment serves and what is given, reports what it deleted, and deletes
nothing when it cannot learn what is served."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import jsonschema
import pytest

from posttrain.inference.contract import HotLoadAPIError
from posttrain.pipeline.blocks import ObjectStore
from posttrain.pipeline.parameters import ParameterError, from_parameters, parameter_fields
from posttrain.pipeline.settings import GcSettings, NightlySettings
from posttrain.pipeline.tasks import retention
from posttrain.promote.history import History
from posttrain.storage import LocalStore
from tests.publish.test_gc_history import record
from tests.support.chains import publish_runs, snapshots_in

NIGHTLY = dict(run_name="nightly", base_model="/m", dataset="/d.jsonl", shared_dir="/shared",
               reward_funcs=["posttrain.rewards:format_reward"], max_steps=2)


def test_gc_parameters_are_flat_typed_and_off_by_default():
    from posttrain.pipeline.flows.nightly import nightly_post_training

    props = nightly_post_training.parameters.model_dump()["properties"]
    assert {"gc_keep_runs", "gc_keep_days", "gc_protect"} <= set(props) <= set(parameter_fields(NightlySettings))
    settings = from_parameters(NightlySettings, NIGHTLY)
    assert settings.gc == GcSettings() and not settings.gc.enabled
    on = from_parameters(NightlySettings, {**NIGHTLY, "gc_keep_runs": 3, "gc_protect": ["step-00000001-ab"]})
    assert on.gc.enabled and on.gc.gc_keep_runs == 3 and on.gc.gc_protect == ["step-00000001-ab"]
    assert from_parameters(NightlySettings, {**NIGHTLY, "gc_keep_days": 1.5}).gc.enabled
    schema = nightly_post_training.parameters.model_dump()
    schema["additionalProperties"] = False
    jsonschema.validate({**NIGHTLY, "gc_keep_runs": 2}, schema)
    for bad, where in (({"gc_keep_runs": 0}, "minimum"), ({"gc_keep_days": 0}, "exclusiveMinimum")):
        with pytest.raises(jsonschema.ValidationError) as e:
            jsonschema.validate({**NIGHTLY, **bad}, schema)
        assert e.value.validator == where


@pytest.mark.parametrize(("bad", "line"), [
    ({"gc_keep_runs": 2, "gc_keep_days": 7},
     "gc_keep_runs and gc_keep_days: give at most one of them (neither: no gc)"),
    ({"gc_keep_runs": 0}, "gc_keep_runs: Input should be greater than or equal to 1"),
    ({"gc_keep_days": -1}, "gc_keep_days: Input should be greater than 0"),
    ({"gc_protect": ["../x"]}, "gc_protect: gc_protect[0] '../x' is not one path segment"),
])
def test_bad_gc_parameters_are_one_line_naming_them(bad, line):
    with pytest.raises(ParameterError) as e:
        from_parameters(NightlySettings, {**NIGHTLY, **bad})
    assert "\n" not in str(e.value) and str(e.value).startswith(line) and "gc." not in str(e.value)


class FakeDeployment:
    def __init__(self, served: set[str] | Exception):
        self.served = served

    @contextmanager
    def hot_loader(self, publish_full=None):
        class Loader:
            def served_identities(inner) -> set[str]:
                if isinstance(self.served, Exception):
                    raise self.served
                return set(self.served)
        yield Loader()


@pytest.fixture
def task_env(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    done = publish_runs(store, tmp_path / "runs", runs=3, steps=3)
    blocks: dict[str, object] = {"posttrain-object-store/s": ObjectStore(uri=str(store.root))}
    tables: list[tuple[str, list[dict], str]] = []
    monkeypatch.setattr(retention, "load_block", lambda ref, what: blocks[ref])
    monkeypatch.setattr(retention, "gc_table", lambda *a: tables.append(a))
    monkeypatch.setattr(retention, "get_run_logger", lambda: logging.getLogger("test-gc-task"))
    return store, done, blocks, tables


def test_the_task_keeps_history_served_and_given_versions_and_reports_the_rest(task_env):
    store, done, blocks, tables = task_env
    n0, n1 = done.identities("night-0"), done.identities("night-1")
    History(store, "", "prod").append(record("promotion", n0[0], None))
    blocks["posttrain-inference-deployment/d"] = FakeDeployment({n1[1], "step-00000001-" + "f" * 32})
    out = retention.collect_garbage.fn("posttrain-object-store/s", GcSettings(gc_keep_runs=1, gc_protect=[n0[2]]),
                                       [], inference=["posttrain-inference-deployment/d"], card="nightly")
    assert snapshots_in(store) == set(done.identities("night-2")) | set(n0) | set(n1[:2])
    assert out["deleted"] == 1 and out["freed_bytes"] > 0 and out["skipped"] == {}
    assert out["kept_runs"] == ["night-2"] and out["runs"] == 3
    assert out["protected"] == {n0[0]: "history of prod", n0[2]: "--protect",
                                n1[1]: "served by posttrain-inference-deployment/d"}
    ((card, rows, description),) = tables
    assert card == "nightly" and [r["identity"] for r in rows] == [n1[2]] and rows[0]["run"] == "night-1"
    assert description.startswith("gc of ") and "1 snapshot deleted" in description


def test_a_deployment_that_cannot_be_read_stops_the_task_before_any_delete(task_env):
    store, done, blocks, tables = task_env
    blocks["posttrain-inference-deployment/d"] = FakeDeployment(HotLoadAPIError("list hot-loads: 403 forbidden"))
    with pytest.raises(HotLoadAPIError):
        retention.collect_garbage.fn("posttrain-object-store/s", GcSettings(gc_keep_runs=1), [],
                                     inference=["posttrain-inference-deployment/d"])
    assert snapshots_in(store) == done.all_identities() and tables == []
