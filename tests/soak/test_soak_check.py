"""The soak's independent checker (posttrain/testing/soak/check*.py, bench/soak_check.py) on synthetic
soak folders: a clean one (three tiny-model versions published by the real Publisher into a moto
store, a promotion history written by the product's History, greedy replies computed by the
server's own sampler, a GRPO run's rounds and checkpoints, a fake Prefect API and gateway) that
must give no violation, and one injected defect per check that it must name."""

from __future__ import annotations

import importlib.util
import json
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from posttrain.testing.soak.check import run_checks, table
from tests.support.s3 import raw_client, s3_config

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8, 9]
T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def iso(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


class FakeSystem:
    """A fake Prefect API (/api/flow_runs/<id>, /api/flow_run_states/?flow_run_id=<id>) and production gateway
    (/health, /metrics)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict] = {}
        self.states: dict[str, list[dict]] = {}  # a run's state history
        self.served: str | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.startswith("/api/flow_runs/"):
                    body = fake.runs.get(self.path.rsplit("/", 1)[1])
                elif self.path.startswith("/api/flow_run_states/?flow_run_id="):
                    body = fake.states.get(self.path.rsplit("=", 1)[1], [])
                elif self.path == "/health":
                    body = {"status": "ok", "snapshotIdentity": fake.served}
                elif self.path == "/metrics":
                    text = f'posttrain_replica_snapshot_info{{replica="replica-0000",identity="{fake.served or ""}",' \
                           'policy_version="2"} 1.0\n'
                    return self.reply(200, text.encode())
                else:
                    body = None
                self.reply(200 if body is not None else 404, json.dumps(body or {}).encode())

            def reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@dataclass
class Built:
    dir: Path
    store: object
    bucket: str
    prefix: str
    endpoint: str
    ids: list[str]  # versions of m0, m1, m2 (steps 1, 2, 3)
    fake: FakeSystem
    grpo: Path
    rows: dict[str, list[dict]] = field(default_factory=dict)

    def write(self, name: str) -> None:
        (self.dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.rows[name]))

    def check(self, *only: str) -> list:
        return run_checks(self.dir, only=list(only) or None)

    def put(self, key: str, body: bytes) -> None:
        raw_client(self.endpoint).put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=body)


def violations(results: list, name: str) -> list[str]:
    return [v for r in results if r.name == name for v in r.violations]


_REPLIES: dict[tuple, list[dict]] = {}  # the identities are deterministic: computed once per session


def _replies(chain, ids: list[str]) -> list[dict]:
    key = tuple(ids)
    if key not in _REPLIES:
        _REPLIES[key] = _sample_replies(chain, ids)
    return json.loads(json.dumps(_REPLIES[key]))


def _sample_replies(chain, ids: list[str]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from posttrain.serve.sampler import sample

    rows = []
    for folder, ident in zip(chain.models, [None, ids[1], ids[2]], strict=True):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        for prompt in (PROMPT, [11, 12, 13]):
            (c,) = sample(model, [prompt], n=1, max_tokens=8, temperature=0.0, top_p=1.0,
                          eos_token_ids={model.config.eos_token_id}, pad_token_id=0)
            rows.append({"at": iso(30), "deployment": "production", "status": 200, "identity": ident,
                         "prompt_ids": prompt, "token_ids": c.token_ids, "logprobs": c.logprobs, "max_tokens": 8,
                         "temperature": 0.0, "error": None})
    rows.append({"at": iso(31), "deployment": "production", "status": 0, "identity": None, "prompt_ids": PROMPT,
                 "token_ids": None, "logprobs": None, "max_tokens": 8, "temperature": 0.0, "error": "refused"})
    return rows


def _history(store, ids: list[str]) -> None:
    from posttrain.promote.decision import Decision
    from posttrain.promote.history import History, Record

    def decision(candidate: str, champion: str | None) -> Decision:
        return Decision(accepted=True, reason="accepted: test", rule="superiority", margin=0.0, confidence=0.95,
                        bootstrap_samples=100, seed=0, candidate=candidate, champion=champion, prompts=8,
                        samples_per_prompt=1)

    h = History(store, "", "prod")
    h.append(Record(kind="promotion", deployment="prod", identity=ids[1], previous=None, run="nightly-fr-1",
                    decision=decision(ids[1], None), reason="accepted: first"))
    h.append(Record(kind="promotion", deployment="prod", identity=ids[2], previous=ids[1], run="nightly-fr-2",
                    decision=decision(ids[2], ids[1]), reason="accepted: better"))
    h.append(Record(kind="rollback", deployment="prod", identity=ids[1], previous=ids[2], run=None,
                    reason=f"rolled back from {ids[2]} to the previous champion"))


def _grpo(root: Path) -> Path:
    """A GRPO run of 3 rounds, max_staleness 1: round 0 and 1 sampled from version 0, round 2 from 1."""
    from posttrain.trainer.grpo_update import PolicyState
    from posttrain.trainer.rounds import hand_round, round_dir

    run = root / "grpo-a"
    for r, version in enumerate([0, 0, 1]):
        folder = round_dir(run / "rounds", r)
        folder.mkdir(parents=True)
        rows = [{"prompt_ids": [1, 2], "completion_ids": [3], "logprobs": [-0.5], "reward": float(i % 2),
                 "group_id": i // 2, "policy_version": version, "snapshot_identity": None} for i in range(4)]
        (folder / "rollouts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        ready = hand_round(run / "rounds", r, version)
        ck = run / "policy" / f"checkpoint-{r + 1}"
        ck.mkdir(parents=True)
        state = PolicyState(global_step=r + 1, policy_version=r + 1, source_checkpoint="x",
                            rollouts=str(folder / "rollouts.jsonl"), rollouts_sha256=ready.rollouts_sha256,
                            rollouts_used=4, rollouts_dropped_stale=0, metrics={"loss": 0.1}, created=T0)
        (ck / "trainer_state.json").write_text(state.model_dump_json())
    return run


_TEMPLATE: dict = {}


def _published(chain, endpoint: str, bucket: str, tmp_path_factory) -> list[str]:
    """Once per session: the three versions published by the real Publisher, and the history."""
    from posttrain.publish import PublishConfig, Publisher
    from posttrain.storage import S3Store

    if not _TEMPLATE:
        cfg = s3_config(endpoint, bucket)
        with S3Store(cfg) as store:
            work = tmp_path_factory.mktemp("publish")
            with Publisher(store, PublishConfig(run="night-1", work_dir=work, async_publish=False)) as pub:
                ids = [pub.publish_step(m, step).identity for step, m in enumerate(chain.models, start=1)]
            _history(store, ids)
        listed = raw_client(endpoint).list_objects_v2(Bucket=bucket, Prefix=cfg.prefix + "/")["Contents"]
        _TEMPLATE.update(prefix=cfg.prefix, ids=ids, keys=[o["Key"][len(cfg.prefix) + 1:] for o in listed])
    return list(_TEMPLATE["ids"])


@pytest.fixture
def built(tmp_path: Path, tmp_path_factory, chain, moto_bucket, monkeypatch: pytest.MonkeyPatch):
    from posttrain.storage import S3Store

    endpoint, bucket = moto_bucket
    cfg = s3_config(endpoint, bucket)
    ids = _published(chain, endpoint, bucket, tmp_path_factory)
    client = raw_client(endpoint)
    for key in _TEMPLATE["keys"]:  # a private copy of the published store
        client.copy_object(Bucket=bucket, Key=f"{cfg.prefix}/{key}",
                           CopySource={"Bucket": bucket, "Key": f"{_TEMPLATE['prefix']}/{key}"})
    store = S3Store(cfg)
    fake = FakeSystem()
    fake.served = ids[1]
    monkeypatch.setenv("SOAK_TEST_AK", "test")
    monkeypatch.setenv("SOAK_TEST_SK", "test")
    soak = tmp_path / "soak"
    soak.mkdir()
    gw_work = tmp_path / "gw-prod"
    gw_work.mkdir()
    (gw_work / "state.json").write_text(json.dumps({"version": 1, "identity": ids[1], "folder": ids[1]}))
    runs_root = tmp_path / "runs"
    grpo = _grpo(runs_root)
    (soak / "soak.json").write_text(json.dumps({
        "seed": 1, "minutes": 1, "backend": "local", "started_at": iso(0), "ended_at": iso(600),
        "store": {"endpoint_url": endpoint, "bucket": bucket, "prefix": cfg.prefix, "region": "us-east-1"},
        "credentials_env": {"access_key": "SOAK_TEST_AK", "secret_key": "SOAK_TEST_SK"},
        "prefect_api_url": fake.url + "/api",
        "deployments": {"production": {"deployment_id": "prod", "gateway_url": fake.url, "work_dir": str(gw_work),
                                       "history": {"prefix": cfg.prefix, "deployment": "prod"}, "final": None},
                        "staging": {"deployment_id": "staging", "gateway_url": None, "history": None}},
        "gateway_token_env": None, "max_staleness": 1, "work_pool": "soak", "run_dirs": [str(runs_root)],
        "base_model": str(chain.models[0]), "unfinished_runs": []}))
    b = Built(soak, store, bucket, cfg.prefix, endpoint, ids, fake, grpo)
    fake.runs = {"fr-1": {"state": {"type": "COMPLETED", "name": "Completed", "message": None},
                          "start_time": iso(10), "end_time": iso(100)},
                 "fr-2": {"state": {"type": "FAILED", "name": "Failed",
                                    "message": "publish failed: [Errno 28] No space left on device"},
                          "start_time": iso(110), "end_time": iso(200)}}
    b.rows = {
        "schedule": [{"at_s": 150, "kind": "spool_full", "target": "shared", "duration_s": 20}],
        "faults": [{"kind": "spool_full", "target": "shared", "started_at": iso(150), "ended_at": iso(170),
                    "detail": "tmpfs filled", "planned_at_s": 150, "injected": True},
                   {"kind": "worker_kill", "target": "worker", "started_at": iso(50), "ended_at": iso(52),
                    "detail": "nothing to hit", "planned_at_s": 50, "injected": False}],
        "runs": [{"flow_run_id": "fr-1", "deployment": "nightly-post-training/nightly", "kind": "nightly",
                  "night": 0, "started_at": iso(10)},
                 {"flow_run_id": "fr-2", "deployment": "grpo/grpo", "kind": "grpo", "night": 0,
                  "started_at": iso(110)}],
        "operator": [{"at": iso(300), "action": "rollback", "rc": 0, "output_tail": "ok",
                      "argv": ["posttrain", "rollback", "--deployment", "prod", "--to", "previous"]}],
        "replies": _replies(chain, ids),
    }
    for name in b.rows:
        b.write(name)
    yield b
    fake.close()
    store.close()


def test_a_clean_soak_has_no_violation(built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    results = built.check()
    assert [r.name for r in results] == ["soak folder", "snapshots", "histories", "replies", "rounds", "runs",
                                         "leftovers"]
    assert not [v for r in results for v in r.violations], table(results)
    items = {r.name: r.items for r in results}
    # 3 snapshots + 3 ledger entries; 3 records + production + the operator's rollback; 7 replies (6 at 200);
    # 3 checkpoints + 3 markers; 2 runs; the production replica's metrics
    assert items == {"soak folder": 1 + 1 + 2 + 2 + 1 + 7, "snapshots": 6, "histories": 5, "replies": 7,
                     "rounds": 6, "runs": 2, "leftovers": 1}, table(results)
    notes = " ".join(n for r in results for n in r.notes)
    assert "1 replies without status 200 not checked" in notes and "killed by spool_full" in notes
    spec = importlib.util.spec_from_file_location("soak_check", ROOT / "bench" / "soak_check.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main([str(built.dir)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["check", "items", "violations", "skipped"] and "VIOLATION" not in out


def test_a_deleted_object_and_an_orphan_are_named(built: Built) -> None:
    client = raw_client(built.endpoint)
    client.delete_object(Bucket=built.bucket, Key=f"{built.prefix}/{built.ids[2]}/model-00000.safetensors")
    built.put("step-00000009-" + "e" * 32 + "/model-00000.safetensors", b"half an upload")
    results = built.check("snapshots", "histories")
    found = violations(results, "snapshots")
    assert any(built.ids[2] in v and "missing from the store" in v for v in found), found
    assert any("orphan" in v and "step-00000009" in v and "no index" in v for v in found), found
    # the history needs the version it promoted: gc must have kept it whole
    assert any(built.ids[2] in v and "cannot be rebuilt" in v for v in violations(results, "histories"))


def test_a_corrupt_delta_fails_its_checksums(built: Built) -> None:
    key = f"{built.prefix}/{built.ids[1]}/model-00000.safetensors"
    client = raw_client(built.endpoint)
    data = bytearray(client.get_object(Bucket=built.bucket, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=built.bucket, Key=key, Body=bytes(data))
    found = violations(built.check("snapshots"), "snapshots")
    assert any(built.ids[1] in v and "does not match" in v for v in found), found
    assert any(built.ids[2] in v and f"needs {built.ids[1]}" in v for v in found), found


def test_a_reply_stamped_with_the_wrong_identity_is_named(built: Built) -> None:
    wrong = next(r for r in built.rows["replies"] if r["identity"] == built.ids[1])
    wrong["identity"] = built.ids[2]
    nan = next(r for r in built.rows["replies"] if r["identity"] is None and r["status"] == 200)
    nan["logprobs"][0] = float("nan")
    built.write("replies")
    found = violations(built.check("replies"), "replies")
    assert len(found) == 2, found
    assert any(f"stamped {built.ids[2]}" in v and ("not the greedy choice" in v or "log-prob" in v) for v in found)
    assert any("NaN" in v for v in found), found


def test_a_round_trained_twice_and_a_stale_rollout_are_named(built: Built) -> None:
    state = json.loads((built.grpo / "policy" / "checkpoint-3" / "trainer_state.json").read_text())
    twice = built.grpo / "policy" / "checkpoint-4"
    twice.mkdir()
    (twice / "trainer_state.json").write_text(json.dumps({**state, "global_step": 4, "policy_version": 4}))
    rows = [json.loads(x) for x in (built.grpo / "rounds" / "0001" / "rollouts.jsonl").read_text().splitlines()]
    assert rows  # round 1 trains version 1: rollouts of version 0 are within the bound, -1 would not be
    marker = json.loads((built.grpo / "rounds" / "0000" / "ready.json").read_text())
    assert marker["policy_versions"] == [0]
    found = violations(built.check("rounds"), "rounds")
    assert any("round 2 was trained 2 times" in v for v in found), found
    assert any("do not follow the round numbers" in v for v in found), found


def test_rollouts_beyond_the_staleness_bound_are_named(built: Built) -> None:
    meta = json.loads((built.dir / "soak.json").read_text())
    meta["max_staleness"] = 0  # round 1 was sampled from version 0 and trains version 1
    (built.dir / "soak.json").write_text(json.dumps(meta))
    found = violations(built.check("rounds"), "rounds")
    assert any("round 1" in v and "beyond max_staleness 0" in v for v in found), found
    assert any("checkpoint-2: 4 rollouts entered the loss, only 0" in v for v in found), found


def test_a_run_failed_without_a_fault_is_named(built: Built) -> None:
    built.fake.runs["fr-1"]["state"] = {"type": "FAILED", "name": "Failed", "message": "ValueError: boom"}
    built.fake.runs["fr-3"] = {"state": {"type": "RUNNING", "name": "Running"}, "start_time": iso(400)}
    lost = "No heartbeat for 90 s: the worker running this flow run was lost."
    retry = {"name": "AwaitingRetry", "message": "posttrain recover: retry 1 of at most 3 without a person"}
    for rid, retried in (("fr-4", 1), ("fr-5", 3)):  # a worker kill: retried 3 times, left Crashed after
        built.fake.runs[rid] = {"state": {"type": "CRASHED", "name": "Crashed", "message": lost}, "run_count": 4,
                                "start_time": iso(400), "end_time": iso(520)}
        built.fake.states[rid] = [{"name": "Running"}, retry, {"name": "AwaitingRetry", "message": "by a person"},
                                  *[retry] * (retried - 1), {"name": "Crashed", "message": lost}]
    built.rows["faults"].append({"kind": "worker_kill", "target": "worker", "started_at": iso(420),
                                 "ended_at": iso(421), "detail": "SIGKILL", "planned_at_s": 420, "injected": True})
    built.rows["runs"] += [{"flow_run_id": rid, "deployment": "grpo/grpo", "kind": "grpo", "night": 1,
                            "started_at": iso(400)} for rid in ("fr-3", "fr-4", "fr-5")]
    built.write("runs")
    built.write("faults")
    results = built.check("runs")
    found = violations(results, "runs")
    assert len(found) == 3, found
    assert any("fr-1" in v and "no injected fault" in v for v in found), found
    assert any("fr-3" in v and "did not end" in v for v in found), found
    assert any("fr-4" in v and "Crashed after 1 retries without a person (the bound is 3)" in v for v in found), found
    assert any("fr-5" in n and "killed by worker_kill" in n for r in results for n in r.notes)


def test_a_promotion_lost_to_another_operation_passes_only_when_that_operation_was_there(built: Built) -> None:
    held = ("OperationLost: deployment prod is held by promotion nightly-abcdef12-3456-7890-abcd-ef1234567890 "
            "(pid 1 on vm) until 2026-12-03T19:09:39Z (82s); nothing was changed")
    rolled = "OperationLost: deployment prod is held by rollback (pid 2 on vm) until 2026-12-03T19:33:00Z (9s)"
    runs = {"fr-6": held, "fr-7": held.replace("abcdef12", "99999999"), "fr-8": rolled}
    for rid, message in runs.items():
        built.fake.runs[rid] = {"state": {"type": "FAILED", "name": "Failed", "message": message},
                                "start_time": iso(700), "end_time": iso(760)}
    built.fake.runs["fr-7"].update(start_time=iso(1500), end_time=iso(1560))
    built.rows["runs"] += [{"flow_run_id": rid, "deployment": "nightly-post-training/nightly", "kind": "nightly",
                            "night": 2, "started_at": iso(1500 if rid == "fr-7" else 700)} for rid in runs]
    # fr-6 lost to a run of the soak (its name holds the run's id); fr-7's holder is no run of the soak, and no
    # operator action overlapped it (the nightly runs of the rows start long before); fr-8 met an operator rollback
    built.rows["runs"].append({"flow_run_id": "abcdef12-3456-7890-abcd-ef1234567890", "deployment": "promote/promote",
                               "kind": "promote", "night": 2, "started_at": iso(100)})
    built.fake.runs["abcdef12-3456-7890-abcd-ef1234567890"] = {"state": {"type": "COMPLETED", "name": "Completed"}}
    built.rows["operator"].append({"at": iso(730), "action": "rollback", "rc": 0, "flow_run_id": None})  # fr-8's
    built.write("runs")
    built.write("operator")
    results = built.check("runs")
    found = violations(results, "runs")
    assert not any("fr-6" in v or "fr-8" in v for v in found), found
    assert any("fr-7" in v for v in found), found
    notes = [n for r in results for n in r.notes]
    assert any("fr-6" in n and "concurrent promotion" in n for n in notes), notes
    assert any("fr-8" in n and "concurrent operation" in n for n in notes), notes


def test_a_leftover_lease_is_named(built: Built) -> None:
    lease = {"holder": "publisher", "host": "h", "pid": 1, "expires_at": 1.0, "run": None, "pending": None}
    built.put(".posttrain/runs/night-1/leases/publish-0123.json", json.dumps(lease).encode())
    built.put(".posttrain/deployments/prod/lease.json", json.dumps({**lease, "pending": built.ids[2]}).encode())
    results = built.check("leftovers", "histories")
    found = violations(results, "leftovers")
    assert len(found) == 2 and all("store lease left behind" in v for v in found), found
    assert any(f"pending={built.ids[2]}" in v for v in violations(results, "histories"))


def test_a_history_record_out_of_order_and_a_wrong_champion_are_named(built: Built) -> None:
    record = {"format": "posttrain.promotion/1", "seq": 4, "kind": "rollback", "deployment": "prod",
              "identity": built.ids[0], "previous": built.ids[2], "run": None, "at": iso(500), "decision": None,
              "reason": "written by a writer that missed record 3", "reverts": None}
    built.put(".posttrain/promotions/prod/00000004.json", json.dumps(record).encode())
    built.fake.served = built.ids[2]
    found = violations(built.check("histories"), "histories")
    assert any("record 4" in v and f"previous is {built.ids[2]}" in v and f"leave {built.ids[1]}" in v
               for v in found), found
    assert any("live /health" in v and f"serves {built.ids[2]}" in v for v in found), found
    assert any("state.json" in v for v in found), found  # the gateway's own state: the old champion
    built.put(".posttrain/promotions/prod/00000006.json", json.dumps({**record, "seq": 6}).encode())
    found = violations(built.check("histories"), "histories")
    assert any("without a gap (missing [5])" in v for v in found), found


def test_offline_skips_what_needs_the_running_system(built: Built) -> None:
    built.fake.close()
    meta = json.loads((built.dir / "soak.json").read_text())
    meta["deployments"]["production"]["final"] = {"health": {"snapshotIdentity": built.ids[1]}, "metrics_file": None}
    (built.dir / "soak.json").write_text(json.dumps(meta))
    results = run_checks(built.dir, live=False)
    assert not [v for r in results for v in r.violations], table(results)
    skipped = {r.name: len(r.skipped) for r in results}
    assert skipped["runs"] == 2 and skipped["leftovers"] == 1


def test_history_replay_follows_reverted_records_and_names_double_decisions() -> None:
    from posttrain.testing.soak.check_replay import replay

    a, b, c = (f"step-0000000{i}-{'abc'[i - 1] * 32}" for i in range(1, 4))

    def rec(seq: int, kind: str, ident: str, prev: str | None, run: str | None = "nightly-1", **kw) -> dict:
        accepted = {"promotion": True, "refusal": False}.get(kind)
        return {"format": "posttrain.promotion/1", "seq": seq, "kind": kind, "deployment": "prod", "identity": ident,
                "previous": prev, "run": run, "at": iso(seq), "reason": kw.pop("reason", "r"),
                "decision": None if accepted is None else {"accepted": accepted, "candidate": ident, "champion": prev},
                "reverts": kw.pop("reverts", None)}

    good = [rec(1, "promotion", a, None, "nightly-1"), rec(2, "promotion", b, a, "nightly-2"),
            rec(3, "reverted", b, b, "nightly-2", reverts=2), rec(4, "refusal", c, a, "nightly-3"),
            rec(5, "promotion", c, a, "promote-1"),
            rec(6, "rollback", a, c, None, reason=f"rolled back from {c} to the previous champion")]
    rep = replay("prod", {r["seq"]: r for r in good})
    assert rep.problems == [] and rep.champion == a and rep.stack == [a]
    assert set(rep.kept) == {a, b, c} and rep.switched_to == {a, b, c}
    bad = [*good[:5], rec(6, "rollback", b, c, None, reason=f"rolled back from {c} to the previous champion"),
           rec(7, "promotion", b, b, "promote-1"), rec(8, "reverted", b, b, "x", reverts=1)]
    problems = replay("prod", {r["seq"]: r for r in bad}).problems
    assert any("record 6" in p and "entry under the top is " + a in p for p in problems), problems
    assert any("record 7" in p and "already the champion" in p for p in problems), problems
    assert any("record 8" in p and "records [2, 5, 6, 7] switched production in between" in p for p in problems)
    assert any("run promote-1 recorded 2 decisions" in p for p in problems), problems
