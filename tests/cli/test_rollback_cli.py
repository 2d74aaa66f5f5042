"""``posttrain rollback`` and ``posttrain history`` as an operator runs them, against a real reference
server: ``--to previous`` makes production serve the earlier champion again and records it; a dry
run and every bad input change nothing (no hot-load created, no record written); the token never
shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
from posttrain.promote.decision import Decision
from posttrain.promote.history import History, Record
from posttrain.promote.promoter import load_version
from posttrain.storage import open_store
from tests.support.s3 import free_port
from tests.support.serving import PREFIX, TOKEN, Api, start_server

DEPLOYMENT = "prod"


def posttrain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "CW_API_TOKEN"}
    return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=180,
                          env={**base, "CW_API_TOKEN": TOKEN, **(env or {})})


def decision(candidate: str, champion: str | None, means: tuple[float, float | None]) -> Decision:
    return Decision(accepted=True, reason="accepted: test", rule="superiority", margin=0.0, confidence=0.95,
                    bootstrap_samples=10_000, seed=0, candidate=candidate, champion=champion, prompts=10,
                    samples_per_prompt=2, candidate_mean=means[0], champion_mean=means[1])


def promotion(identity: str, previous: str | None, means: tuple[float, float | None]) -> Record:
    return Record(kind="promotion", deployment=DEPLOYMENT, identity=identity, previous=previous, run="nightly-1",
                  decision=decision(identity, previous, means), reason="accepted: better")


class Site:
    def __init__(self, chain, store_copy: Path, tmp_path: Path):
        self.chain, self.root = chain, store_copy
        self.server = start_server(chain, tmp_path / "work", store_copy, deployment_id=DEPLOYMENT)
        self.api = Api(self.server.url)
        self.store = open_store(str(store_copy / PREFIX))
        self.history = History(self.store, "", DEPLOYMENT)

    def close(self) -> None:
        self.store.close()
        self.server.shutdown()

    def args(self, *more: str) -> list[str]:
        return ["--store", str(self.root), "--prefix", PREFIX, "--deployment", DEPLOYMENT, *more]

    def rollback(self, *more: str, **kw) -> subprocess.CompletedProcess:
        return posttrain("rollback", *self.args("--api-url", self.server.url, "--poll-interval", "0.05", *more), **kw)

    def served(self) -> set[str]:
        ops = self.api.get("/v1alpha1/inference/hotLoads",
                           params={"parentDeploymentId": DEPLOYMENT, "maxPageSize": 1}).json()["hotLoads"]
        replicas = self.api.get(f"/v1alpha1/inference/hotLoads/{ops[0]['spec']['id']}/replicas").json()["replicas"]
        return {r["currentSnapshotIdentity"] for r in replicas}

    def state(self) -> tuple:
        """What must not change: the history's files, the hot-loads the server has, what it serves."""
        folder = self.root / PREFIX / ".posttrain" / "promotions" / DEPLOYMENT
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
        ops = self.api.get("/v1alpha1/inference/hotLoads",
                           params={"parentDeploymentId": DEPLOYMENT, "maxPageSize": 1000}).json()["hotLoads"]
        return files, [o["spec"]["id"] for o in ops], self.served()


@pytest.fixture
def site(chain, store_copy, tmp_path):
    """Production serves d2 (promoted after d1); its history says so."""
    s = Site(chain, store_copy, tmp_path)
    try:
        s.history.append(promotion(chain.d1, None, (0.42, None)))
        s.history.append(promotion(chain.d2, chain.d1, (0.91, 0.42)))
        with CoreWeaveHotLoader(HotLoadConfig(api_url=s.server.url, deployment_id=DEPLOYMENT, token=TOKEN,
                                              poll_interval=0.05, timeout=60)) as loader:
            load_version(loader, s.store, chain.d2)
        assert s.served() == {chain.d2} and s.api.greedy() == chain.greedy[2]
        yield s
    finally:
        s.close()


def test_rollback_to_previous_serves_the_earlier_champion_and_records_it(site, chain):
    proc = site.rollback("--to", "previous", "--reason", "d2 answers worse in production")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith(f"{DEPLOYMENT} serves {chain.d1} now (previous champion: {chain.d2}); recorded as #3 ")
    assert site.served() == {chain.d1} and site.api.greedy() == chain.greedy[1]
    records = site.history.records()
    assert [r.kind for r in records] == ["promotion", "promotion", "rollback"]
    last = records[-1]
    assert (last.identity, last.previous, last.run, last.reason) == (chain.d1, chain.d2, None,
                                                                    "d2 answers worse in production")
    assert site.history.champion() == chain.d1 and site.history.previous_champion() is None
    assert TOKEN not in proc.stdout + proc.stderr

    again = site.rollback("--to", "previous")  # d1 was the first champion: nothing earlier
    assert again.returncode == 2
    assert again.stderr.splitlines() == [f"posttrain: error: --to previous: deployment {DEPLOYMENT} has no earlier "
                                         f"champion in its history (3 records; the champion {chain.d1} is the first)"]
    forward = site.rollback("--to", chain.d2, "--token-env", "OTHER_TOKEN", env={"OTHER_TOKEN": TOKEN})
    assert forward.returncode == 0, forward.stderr
    assert site.served() == {chain.d2}
    assert site.history.records()[-1].reason == f"rolled back from {chain.d1} to {chain.d2}"


def test_dry_run_says_what_it_would_do_and_changes_nothing(site, chain):
    before = site.state()
    proc = site.rollback("--to", "previous", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"dry run: deployment {DEPLOYMENT} at {site.server.url} would hot-load {chain.d1} (a delta of {chain.full}) "
        f"from {site.store.uri}",
        f"the API reports it serving now: {chain.d2}; its history's champion: {chain.d2}",
        f"would record #3: rollback of {DEPLOYMENT} to {chain.d1}, previous {chain.d2}, reason: (the default: what "
        "was rolled back)",
        "nothing was hot-loaded or recorded",
    ]
    full = site.rollback("--to", chain.full, "--dry-run")
    assert full.returncode == 0, full.stderr
    assert f"would hot-load {chain.full} (a full snapshot)" in full.stdout
    assert site.state() == before


BAD = [
    (["--to", "step-00000009-" + "f" * 32], "--to step-00000009-ffffffffffffffffffffffffffffffff: unknown identity "
     "step-00000009-ffffffffffffffffffffffffffffffff"),
    (["--to", "../etc"], "--to '../etc' is not one path segment matching [A-Za-z0-9][A-Za-z0-9_.-]* (give previous or "
     "a snapshot identity)"),
    (["--to", "{d2}"], "--to {d2}: {d2} is already the champion of prod"),
    (["--to", "previous", "--deployment", "a/b"], "--deployment: deployment name 'a/b' must be"),
    (["--to", "previous", "--deployment", "staging"], "--to previous: deployment staging has no earlier champion in "
     "its history (0 records; no promotion yet)"),
    (["--to", "previous", "--token-env", "NO_SUCH_TOKEN_VAR"], "--token-env NO_SUCH_TOKEN_VAR: environment variable "
     "NO_SUCH_TOKEN_VAR (the API token) is not set"),
    (["--to", "previous", "--token-file", "{tmp}/missing"], "--token-file {tmp}/missing: cannot read the token file "
     "{tmp}/missing: No such file or directory"),
    (["--to", "previous", "--api-url", "ftp://example"], "--api-url ftp://example: "),
    (["--to", "previous", "--api-url", "http://127.0.0.1:{port}"], "--api-url http://127.0.0.1:{port}: the hot-load "
     "API cannot be reached (Connection refused)"),
    (["--to", "previous", "--token-env", "WRONG"], "--token-env WRONG: the hot-load API at {url} refused the token "
     "(HTTP 401)"),
    (["--to", "previous", "--timeout", "0"], "--timeout 0: must be above 0 seconds"),
    (["--to", "previous", "--store", "{tmp}/nope"], "--store {tmp}/nope: no such folder"),
]


@pytest.mark.parametrize(("args", "line"), BAD, ids=["unknown", "malformed", "champion", "bad-deployment",
                                                     "no-history", "no-token", "no-token-file", "bad-url",
                                                     "unreachable", "wrong-token", "timeout", "no-store"])
def test_bad_input_is_one_line_naming_the_option_and_changes_nothing(site, chain, tmp_path, args, line):
    before = site.state()
    port = free_port()
    fill = dict(d2=chain.d2, tmp=tmp_path, port=port, url=site.server.url)
    args = [a.format(**fill) for a in args]
    proc = site.rollback(*args, env={"WRONG": "not-the-token-PLANTED"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"posttrain: error: {line.format(**fill)}"), lines[0]
    assert proc.stdout == ""
    assert TOKEN not in proc.stderr and "not-the-token-PLANTED" not in proc.stderr
    assert site.state() == before
    assert not (tmp_path / "nope").exists()


def test_the_token_never_shows_even_from_a_file(site, chain, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\nsecond line ignored\n")
    proc = posttrain("rollback", *site.args("--api-url", site.server.url, "--poll-interval", "0.05",
                                            "--token-file", str(token_file), "--to", "previous"),
                     env={"CW_API_TOKEN": ""})
    assert proc.returncode == 0, proc.stderr
    assert site.served() == {chain.d1}
    for cmd in (["history", *site.args()], ["history", *site.args("--json")]):
        out = posttrain(*cmd)
        assert out.returncode == 0 and TOKEN not in out.stdout + out.stderr
    assert TOKEN not in proc.stdout + proc.stderr


def test_history_prints_the_records_the_champion_and_what_previous_restores(site, chain):
    proc = posttrain("history", *site.args())
    assert proc.returncode == 0, proc.stderr
    for col in ("seq", "kind", "identity", "previous", "run", "at", "reason", "candidate", "champion"):
        assert f" {col} " in proc.stdout, col
    rows = [line for line in proc.stdout.splitlines() if " promotion " in line and "history" not in line]
    assert len(rows) == 2 and chain.d1 in rows[0] and chain.d2 in rows[1]
    assert "0.9100" in rows[1] and "0.4200" in rows[1] and "nightly-1" in rows[1]
    assert proc.stdout.splitlines()[-2:] == [f"champion: {chain.d2}",
                                            f"rollback --to previous would restore: {chain.d1}"]

    as_json = posttrain("history", *site.args("--json"))
    assert as_json.returncode == 0, as_json.stderr
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [(r["seq"], r["kind"], r["identity"], r["previous"]) for r in records] == [
        (1, "promotion", chain.d1, None), (2, "promotion", chain.d2, chain.d1)]
    assert [Record.model_validate(r) for r in records] == site.history.records()

    empty = posttrain("history", "--store", str(site.root), "--prefix", PREFIX, "--deployment", "staging")
    assert empty.returncode == 0 and "has no promotion history" in empty.stdout
    bad = posttrain("history", "--store", str(site.root), "--deployment", "a/b")
    assert bad.returncode == 2 and bad.stderr.splitlines()[0].startswith("posttrain: error: --deployment: ")


def test_a_deployment_held_by_another_operation_makes_the_rollback_lose_in_one_line(site, chain):
    """Another promotion or rollback holds the deployment's lease: exit 1, who holds it and until
    when, nothing hot-loaded or recorded; once it is released the same command goes through."""
    from posttrain.promote.lease import holding

    before = site.state()
    with holding(site.store, DEPLOYMENT, "promotion", run="nightly-42"):
        proc = site.rollback("--to", "previous")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"posttrain: error: rollback of {DEPLOYMENT} to {chain.d1}: deployment {DEPLOYMENT} is "
                           "held by promotion nightly-42 (pid ") and line.endswith("s); nothing was changed"), line
    assert " until 20" in line and site.state() == before
    assert site.rollback("--to", "previous").returncode == 0 and site.served() == {chain.d1}
