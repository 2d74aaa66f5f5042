"""Fixtures of the Prefect acceptance tests: a real Prefect server, the deployments of prefect.yaml,
a process worker on ``posttrain-process``, and the embedded defaults on a tiny model.

The server is $PREFECT_API_URL when set (scripts/test.sh starts one on port 4300, on PostgreSQL);
otherwise this session starts one the way scripts/test.sh does (port 4300, its own state folder)
and stops it at the end: on embedded SQLite, or with POSTTRAIN_PREFECT_DB=postgres on a PostgreSQL
server that it also starts (scripts/services/start-postgres.sh, port $POSTGRES_PORT or 55432) and stops. The flows talk to an in-process reference inference server started here; training
runs as a local process. Everything the runs write lives in one temporary folder.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from posttrain.testing.soak.processes import cmdline, descendants

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "services"
TEST_PORT = int(os.environ.get("POSTTRAIN_TEST_PREFECT_PORT", "4300"))
PROCESS_POOL = "posttrain-process"
NIGHTLY = "nightly-post-training/nightly"
GRPO = "grpo/grpo"
DEPLOYMENT_ID = "dep-flows-test"
MODEL_NAME = "tiny"
REWARDS = ["posttrain.rewards:correctness_reward"]
# The trainer of every nightly run here: two steps, a checkpoint after each, seconds on CPU.
SMALL_TRAINER = {"reward_funcs": REWARDS, "learning_rate": 1e-3, "per_device_train_batch_size": 4,
                 "num_generations": 2, "max_completion_length": 4, "max_steps": 2, "save_steps": 1, "use_cpu": True}


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=3) as r:
            return b"true" in r.read()
    except OSError:
        return False


def _prefect_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API URL of a running Prefect server; PREFECT_API_URL points at it for this process and
    every subprocess started here."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    given = os.environ.get("PREFECT_API_URL")
    started_env = None
    if given:
        api = given.rstrip("/")
        if not _healthy(api):
            pytest.fail(f"PREFECT_API_URL={given} does not answer {api}/health; start the server first "
                        "(scripts/services/start-prefect.sh)")
    else:
        api = f"http://127.0.0.1:{TEST_PORT}/api"
        if not _healthy(api):
            started_env = {**os.environ, "PREFECT_PORT": str(TEST_PORT), "PREFECT_UI": "0",
                           "POSTTRAIN_PREFECT_DIR": os.environ.get(
                               "POSTTRAIN_PREFECT_DIR", "/tmp/posttrain-services/prefect-tests"),
                           "POSTTRAIN_BIN_DIR": os.environ.get("POSTTRAIN_BIN_DIR", str(Path(sys.executable).parent))}
            scripts = ["start-prefect.sh"]
            if os.environ.get("POSTTRAIN_PREFECT_DB") == "postgres":
                scripts.insert(0, "start-postgres.sh")
            for script in scripts:
                run = subprocess.run(["bash", str(SCRIPTS / script)], env=started_env, capture_output=True,
                                     text=True, timeout=150)
                if run.returncode != 0:
                    _stop(started_env)
                    pytest.fail(f"PREFECT_API_URL is unset and scripts/services/{script} failed to start a "
                                f"Prefect server on port {TEST_PORT} (rc {run.returncode}):\n{run.stdout}{run.stderr}")
            if not _healthy(api):
                _stop(started_env)
                pytest.fail(f"the Prefect server started on port {TEST_PORT} does not answer {api}/health")
    os.environ["PREFECT_API_URL"] = api
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield api
    finally:
        if given is None:
            os.environ.pop("PREFECT_API_URL", None)
        if started_env is not None:
            _stop(started_env)


def _stop(env: dict) -> None:
    """Stop the Prefect server (and the PostgreSQL server under it) that prefect_api started."""
    subprocess.run(["bash", str(SCRIPTS / "stop-prefect.sh")], env=env, capture_output=True, timeout=120)
    if env.get("POSTTRAIN_PREFECT_DB") == "postgres":
        subprocess.run(["bash", str(SCRIPTS / "stop-postgres.sh")], env=env, capture_output=True, timeout=120)


@dataclass
class TinySetup:
    root: Path
    base_model: Path  # the tiny model: the server's boot weights and the runs' starting point
    dataset: Path  # toy prompts (JSONL)
    shared_dir: Path  # run folders: <shared_dir>/runs/<run_name>
    store: Path  # the folder object store holding the snapshot chains
    jobs_dir: Path  # job folders of the local cluster
    server: object  # the in-process posttrain.serve.server.InferenceServer
    token: str  # its bearer token

    def settings(self, run_name: str, **overrides) -> dict:
        """The parameters of a small nightly run on this setup (the flows take flat parameters)."""
        return {"run_name": run_name, "base_model": str(self.base_model), "dataset": str(self.dataset),
                "shared_dir": str(self.shared_dir), **SMALL_TRAINER, "watch_poll_s": 0.5, **overrides}

    def grpo_settings(self, run_name: str, **overrides) -> dict:
        """The parameters of a GRPO run on this setup: one round of two prompts in one shard, two
        completions of at most four tokens each, and the nightly trainer's settings for its step."""
        from posttrain.pipeline.parameters import parameter_fields
        from posttrain.pipeline.settings import GrpoSettings

        grpo = parameter_fields(GrpoSettings)
        base = {k: v for k, v in self.settings(run_name).items() if k in grpo}
        # round_timeout_s: a resident job whose flow failed waits this long for a retry (a test that
        # failed leaves no trainer behind for the default half hour)
        return {**base, "rounds": 1, "prompts_per_round": 2, "shards": 1, "num_generations": 2,
                "max_completion_length": 4, "reward_funcs": REWARDS, "round_timeout_s": 300, **overrides}

    def served_identity(self) -> str | None:
        """The snapshot the inference server serves, from its /health endpoint."""
        return self._call("GET", "/health")["snapshotIdentity"]

    def add_faults(self, *faults: dict) -> list[dict]:
        """Arm faults on the reference server (``posttrain.serve.faults``); returns those pending."""
        return self._call("POST", "/_test/faults", {"faults": list(faults)})["pending"]

    def pending_faults(self) -> list[dict]:
        return self._call("GET", "/_test/stats")["pending"]

    def clear_faults(self) -> None:
        self._call("DELETE", "/_test/faults")

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.server.url}{path}", data=data, method=method,  # type: ignore[attr-defined]
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())


@pytest.fixture(scope="session")
def tiny_setup(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinySetup]:
    """A tiny model, toy prompts, a folder store, the reference server on a free port (with its fault
    routes, which a test arms through ``add_faults``), and the
    default blocks (``save_default_blocks``) pointing at them; the local cluster keeps its job
    folders under the temporary folder."""
    from posttrain.cluster import LocalConfig
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.models.tiny import build_tiny_model
    from posttrain.pipeline.blocks import LocalCluster
    from posttrain.pipeline.deployments.embedded import DEFAULT, save_default_blocks
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    root = tmp_path_factory.mktemp("flows")
    base = build_tiny_model(root / "models" / "tiny-base", seed=0)
    dataset = write_toy_jsonl(root / "data" / "prompts.jsonl", n=16, seed=0, task="mixed")
    store = root / "store"
    store.mkdir()
    token = secrets.token_urlsafe(16)
    server = InferenceServer(ServeConfig(model_dir=base, served_model_name=MODEL_NAME, port=0,
                                         deployment_id=DEPLOYMENT_ID, store=str(store), token=token,
                                         work_dir=root / "inference", device="cpu", test_hooks=True))
    server.start()
    try:
        save_default_blocks(store_dir=store, server_url=server.url, deployment_id=DEPLOYMENT_ID, model=MODEL_NAME,
                            token=token)
        LocalCluster(settings=LocalConfig(folder=str(root / "jobs"))).save(DEFAULT, overwrite=True)
        yield TinySetup(root=root, base_model=base, dataset=dataset, shared_dir=root / "shared", store=store,
                        jobs_dir=root / "jobs", server=server, token=token)
    finally:
        server.shutdown()


@dataclass
class Deployed:
    nightly_id: str
    schedules: list  # the nightly deployment's schedules as deployed (before the fixture pauses them)
    enforce_parameter_schema: bool


def _cli(args: list[str], *, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def deployed(tiny_setup: TinySetup) -> Deployed:
    """``posttrain prefect-setup`` then ``prefect --no-prompt deploy --all`` from the repo root, with
    the POSTTRAIN_* variables pointing at the tiny setup. The nightly schedule is read, then paused
    (and its scheduled runs deleted), so a real 02:00 run can never land on this session's worker."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, FlowRunFilter
    from prefect.states import Cancelled

    setup = _cli([sys.executable, "-m", "posttrain", "prefect-setup"])
    assert setup.returncode == 0, f"posttrain prefect-setup failed:\n{setup.stdout}{setup.stderr}"
    assert PROCESS_POOL in setup.stdout

    env = {**os.environ, "PWD": str(REPO),  # prefect.yaml's pull step: {{ $PWD }} at deploy time
           "POSTTRAIN_BASE_MODEL": str(tiny_setup.base_model), "POSTTRAIN_DATASET": str(tiny_setup.dataset),
           "POSTTRAIN_SHARED_DIR": str(tiny_setup.shared_dir), "POSTTRAIN_IMAGE": "posttrain:flows-test",
           "POSTTRAIN_PVC": "shared"}
    deploy = _cli(_prefect_cmd("--no-prompt", "deploy", "--all"), env=env)
    assert deploy.returncode == 0, f"prefect deploy --all failed:\n{deploy.stdout}{deploy.stderr}"

    with get_client(sync_client=True) as client:
        d = client.read_deployment_by_name(NIGHTLY)
        deployed = Deployed(nightly_id=str(d.id), schedules=list(d.schedules),
                            enforce_parameter_schema=bool(d.enforce_parameter_schema))
        for s in d.schedules:
            client.update_deployment_schedule(d.id, s.id, active=False)
        scheduled = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [d.id]}),
                                          flow_run_filter=FlowRunFilter(state={"type": {"any_": ["SCHEDULED"]}}))
        for run in scheduled:
            client.delete_flow_run(run.id)
        # Runs that an interrupted earlier session left unfinished hold a deployment's one
        # concurrency slot (until their lease expires, minutes later): end them, which frees it.
        ids = [d.id, client.read_deployment_by_name("grpo/grpo").id]
        stale = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": ids}),
                                      flow_run_filter=FlowRunFilter(
                                          state={"type": {"any_": ["PENDING", "RUNNING", "CANCELLING"]}}))
        for run in stale:
            client.set_flow_run_state(run.id, Cancelled(message="left unfinished by an earlier test session"),
                                      force=True)
    return deployed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return not _alive(proc.pid)


def stop_worker(proc: subprocess.Popen) -> None:
    """A worker turns SIGTERM into SIGINT for itself and does not always exit on it; a second SIGTERM
    makes it SIGKILL itself. So: TERM, wait 3 s, TERM, wait 1 s, KILL (its whole process group, which
    holds the flow runs it started)."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGTERM, 1.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if _wait_gone(proc, wait):
            break
    try:  # flow runs left in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Worker:
    proc: subprocess.Popen
    log: Path

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def lose(self) -> None:
        """What losing the worker (or its login node) does: SIGKILL at once to it and to the flow-run
        processes it started (``python -m prefect.engine``, wherever their session is), and nothing else:
        no signal, no closed pipe reaches a flow run before it dies. The jobs they submitted go on."""
        doomed = [self.proc.pid] + [pid for pid in descendants(self.proc.pid)
                                    if "prefect.engine" in cmdline(pid)]
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGSTOP)  # none may react to another's death
            except ProcessLookupError:
                pass
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_gone(self.proc, 10)

    def restart(self) -> None:
        """A new worker in place of this one (after ``lose``)."""
        stop_worker(self.proc)
        self.proc = _start_worker(self.log)


def _start_worker(log: Path) -> subprocess.Popen:
    """A process worker on posttrain-process polling every second, in its own process group, once it
    says it started."""
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    start = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as out:
        proc = subprocess.Popen(_prefect_cmd("worker", "start", "--pool", PROCESS_POOL, "--type", "process"),
                                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    while "started" not in log.read_bytes()[start:].decode(errors="replace"):
        if proc.poll() is not None:
            pytest.fail(f"the Prefect worker exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            stop_worker(proc)
            pytest.fail(f"the Prefect worker did not start in 60 s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return proc


@pytest.fixture(scope="session")
def process_worker(deployed: Deployed, tiny_setup: TinySetup) -> Iterator[Worker]:
    """A process worker on posttrain-process polling every second, in its own process group."""
    worker = Worker(_start_worker(tiny_setup.root / "worker.log"), tiny_setup.root / "worker.log")
    try:
        yield worker
    finally:
        stop_worker(worker.proc)
