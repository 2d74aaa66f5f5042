"""What the soak starts on top of the services the test command runs (Prefect on PostgreSQL, SeaweedFS,
Slurm): the tiny model and data, a bucket behind the fault proxy, a tmpfs for the runs' folders (the
publishers' spools), three ``posttrain serve`` gateways (production, staging, and rollouts for the
GRPO runs), blocks, a work pool and deployments named ``soak-<seed>-...``, and a process worker, each
process under a restart loop."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from posttrain import redact
from posttrain.testing.soak import ACCESS_KEY_ENV, ROLES, SECRET_KEY_ENV, TOKEN_ENV
from posttrain.testing.soak.processes import Supervised
from posttrain.testing.soak.proxy import StoreFront
from posttrain.testing.soak.record import Recorder

REPO = Path(__file__).resolve().parents[3]
SERVICES = REPO / "scripts" / "services"
MODEL_NAME = "tiny"
PREFIX = "chains"
REGION = "us-east-1"
CRASH_RETRIES = 3  # posttrain recover's default: soak.json says it to the checker
PENDING_TIMEOUT_S = 120  # a run Pending this long is set Crashed by the sweeper (its default is 600 s)
# length_reward varies with the completion (the tiny model is never correct): every step changes the weights,
# so that replies of different snapshots can be told apart
REWARDS = ["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"]
FLOWS = {"nightly": ("nightly-post-training", "posttrain/pipeline/flows/nightly.py:nightly_post_training"),
         "grpo": ("grpo", "posttrain/pipeline/flows/grpo.py:grpo"),
         "promote": ("promote", "posttrain/pipeline/flows/promote.py:promote"),
         "rollback": ("rollback", "posttrain/pipeline/flows/promote.py:rollback")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, token: str | None = None, timeout: float = 3) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def prefect_healthy() -> bool:
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=3) as r:
            return b"true" in r.read()
    except OSError:
        return False


def service_script(name: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """scripts/services/<name>.sh with this process's environment (the services' own)."""
    return subprocess.run(["bash", str(SERVICES / name)], env=dict(os.environ), capture_output=True, text=True,
                          timeout=timeout)


@dataclass
class Gateway:
    role: str
    deployment_id: str
    port: int
    work_dir: Path
    process: Supervised | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def block(self) -> str:
        return f"posttrain-inference-deployment/{self.deployment_id}"


@dataclass
class System:
    seed: int
    root: Path  # the soak's work folder
    rec: Recorder
    backend: str = "local"
    spool_mib: int = 256
    token: str = field(default_factory=lambda: os.urandom(12).hex())
    # one soak's names (pool, deployments, blocks, gateways, bucket): soak-<seed>-<its start, UTC>, so that
    # a soak never picks up another's runs or blocks
    stamp: str = field(default_factory=lambda: time.strftime("%m%d%H%M%S", time.gmtime()))
    gateways: dict[str, Gateway] = field(default_factory=dict)
    spool: dict = field(default_factory=dict)
    store: StoreFront | None = None
    worker: Supervised | None = None
    recover: Supervised | None = None
    bucket: str = ""

    @property
    def name(self) -> str:
        return f"soak-{self.seed}-{self.stamp}"

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def base_model(self) -> Path:
        return self.root / "models" / "tiny-base"

    def deployment(self, kind: str) -> str:
        return f"{FLOWS[kind][0]}/{self.name}-{kind}"

    def env(self) -> dict[str, str]:
        """The environment of every process the soak starts: the services', the store's credentials,
        the gateways' token, one torch thread (2 CPUs: docs/testing.md)."""
        env = dict(os.environ)
        env.setdefault(ACCESS_KEY_ENV, "test")
        env.setdefault(SECRET_KEY_ENV, "test")
        env.update({TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"})
        return env

    # ----- start -----
    def start(self) -> None:
        # the restart faults run the services' own scripts, which need the environment they were started with
        missing = [v for v in ("PREFECT_API_URL", "PREFECT_PORT", "POSTTRAIN_PREFECT_DIR", "POSTTRAIN_PREFECT_DB",
                               "POSTTRAIN_S3_ENDPOINT") if not os.environ.get(v)]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} unset: export the services' environment first "
                               "(set -a; . /tmp/posttrain-services.env; set +a, or run under scripts/test.sh)")
        if not prefect_healthy():
            raise RuntimeError(f"the Prefect server at PREFECT_API_URL={os.environ.get('PREFECT_API_URL')!r} does "
                               "not answer: start the services first (scripts/services/start-prefect.sh)")
        os.environ.update({k: v for k, v in self.env().items() if k in (ACCESS_KEY_ENV, SECRET_KEY_ENV)})
        self._mount_spool()
        self._data()
        self._bucket()
        self.store = StoreFront(os.environ["POSTTRAIN_S3_ENDPOINT"])
        self.rec.log(f"store: s3://{self.bucket}/{PREFIX} through the fault proxy {self.store.url} "
                     f"-> {self.store.upstream}")
        for role in ROLES:
            self._start_gateway(role)
        self._blocks()
        self._deploy()
        self.worker = Supervised("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", self.name,
                                            "--type", "process"], self.rec.logs / "worker.log",
                                 env={**self.env(), "PREFECT_WORKER_QUERY_SECONDS": "2"}, cwd=REPO,
                                 on_event=self.rec.log)
        self.worker.start()
        # beside the worker, as a site runs it (docs/recovery.md): retries the soak's Crashed runs, and
        # sets Crashed the ones stuck Pending
        self.recover = Supervised("recover", [sys.executable, "-m", "posttrain", "recover", "--tag", self.name,
                                              "--retries", str(CRASH_RETRIES), "--every", "5",
                                              "--pending-timeout", str(PENDING_TIMEOUT_S)],
                                  self.rec.logs / "recover.log", env=self.env(), cwd=REPO, on_event=self.rec.log)
        self.recover.start()

    def _mount_spool(self) -> None:
        """The runs' folders (where each publisher spools: <run>/publish) on a tmpfs of ``spool_mib``, so
        that a spool_full fault fills a real file system. Without root (mount refused), a plain folder,
        and spool_full faults record that nothing was injected."""
        self.shared.mkdir(parents=True, exist_ok=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.spool_mib}m", "tmpfs", str(self.shared)],
                               capture_output=True, text=True)
        if mount.returncode == 0:
            self.spool = {"kind": "tmpfs", "path": str(self.shared), "size_mib": self.spool_mib, "why": ""}
        else:
            self.spool = {"kind": "none", "path": str(self.shared), "size_mib": 0,
                          "why": f"mount -t tmpfs refused: {(mount.stderr or mount.stdout).strip()[:200]}"}
        self.rec.log(f"spool: {self.spool}")

    def _data(self) -> None:
        from posttrain.datasets.toy import write_toy_jsonl
        from posttrain.models.tiny import build_tiny_model

        build_tiny_model(self.base_model, seed=0)
        self.dataset = write_toy_jsonl(self.root / "data" / "prompts.jsonl", n=16, seed=0, task="mixed")
        self.eval_dataset = write_toy_jsonl(self.root / "data" / "eval.jsonl", n=8, seed=1, task="mixed")

    def _bucket(self) -> None:
        import boto3

        from botocore.exceptions import EndpointConnectionError

        self.bucket = self.name
        endpoint = os.environ["POSTTRAIN_S3_ENDPOINT"]
        client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
        try:
            client.create_bucket(Bucket=self.bucket)
        except EndpointConnectionError:
            raise RuntimeError(f"the S3 server at POSTTRAIN_S3_ENDPOINT={redact.scrub(endpoint)!r} does not answer: "
                               "start the services first (scripts/services/start-s3.sh)") from None

    def store_args(self) -> list[str]:
        """The options of posttrain gc / rollback / history that name the soak's store (through the proxy)."""
        return ["--store", f"s3://{self.bucket}", "--prefix", PREFIX, "--endpoint-url", self.store.url,
                "--region", REGION]

    def _start_gateway(self, role: str) -> None:
        gw = Gateway(role, f"{self.name}-{role}", free_port(), self.root / "gateways" / role)
        gw.work_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "posttrain", "serve", "--model", str(self.base_model), "--served-model-name",
                MODEL_NAME, "--port", str(gw.port), "--deployment-id", gw.deployment_id, "--store",
                f"s3://{self.bucket}", "--prefix", PREFIX, "--s3-endpoint-url", self.store.url, "--s3-region", REGION,
                "--token-env", TOKEN_ENV, "--work-dir", str(gw.work_dir), "--device", "cpu", "--probe-interval", "5"]
        gw.process = Supervised(f"serve-{role}", argv, self.rec.logs / f"serve-{role}.log", env=self.env(), cwd=REPO,
                                ready=lambda: http_ok(f"{gw.url}/health", self.token), on_event=self.rec.log)
        gw.process.start()
        if not http_ok(f"{gw.url}/health", self.token):
            raise RuntimeError(f"posttrain serve ({role}) did not answer /health: see {gw.process.log}")
        self.gateways[role] = gw

    def cluster(self, kind: str) -> str:
        """The cluster block a run of ``kind`` trains on."""
        if self.backend == "slurm":
            return f"posttrain-slurm-cluster/{self.name}-{kind}"
        return f"posttrain-local-cluster/{self.name}"

    def _slurm_settings(self) -> dict:
        """The test Slurm cluster (scripts/services/start-slurm.sh), one node a job, CPU: the soak's folder is
        its shared storage (the nodes are this machine), its jobs folder the job root, as the local
        cluster's, so that trainer_kill finds the trainers the same way."""
        venv_bin = str(Path(sys.executable).parent)
        env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PATH": f"{venv_bin}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
        return {"shared_dir": str(self.root), "job_root": str(self.jobs), "python": sys.executable, "nodes": 1,
                "gpus_per_node": 0, "memory": "1G", "exclusive": False, "time_limit": "60", "launcher": "python",
                "poll_interval_s": 1, "env": env}

    def _blocks(self) -> None:
        """The soak's blocks as a site saves them: ``posttrain blocks save --from`` a file, secrets by name."""
        blocks = {f"posttrain-object-store/{self.name}": {
                      "uri": f"s3://{self.bucket}/{PREFIX}", "endpoint_url": self.store.url, "region": REGION,
                      "access_key_id": {"env": ACCESS_KEY_ENV}, "secret_access_key": {"env": SECRET_KEY_ENV}},
                  f"posttrain-local-cluster/{self.name}": {"settings": {"folder": str(self.jobs)}}}
        if self.backend == "slurm":  # a block per kind: their jobs may run at once
            for kind in ("nightly", "grpo"):
                blocks[f"posttrain-slurm-cluster/{self.name}-{kind}"] = {"settings": self._slurm_settings()}
        for gw in self.gateways.values():
            blocks[gw.block] = {"api_url": gw.url, "gateway_url": gw.url, "deployment_id": gw.deployment_id,
                                "model": MODEL_NAME, "token": {"env": TOKEN_ENV}, "timeout_s": 600,
                                "poll_interval_s": 0.5}
        path = self.rec.logs / "blocks.yaml"
        path.write_text(yaml.safe_dump(blocks, sort_keys=False))
        saved = self._cli([sys.executable, "-m", "posttrain", "blocks", "save", "--from", str(path)])
        if saved.returncode != 0:
            raise RuntimeError(f"posttrain blocks save failed: {saved.stdout}{saved.stderr}"[-2000:])

    def _cli(self, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        run = subprocess.run(argv, cwd=REPO, env={**self.env(), "PWD": str(REPO)}, capture_output=True, text=True,
                             timeout=timeout)
        (self.rec.logs / "setup.log").open("a").write(f"$ {' '.join(argv)}\nrc {run.returncode}\n{run.stdout}"
                                                       f"{run.stderr}\n")
        return run

    def _deploy(self) -> None:
        """``posttrain prefect-setup`` (the crash automations), a process pool of the soak's own, and its
        deployments from a prefect.yaml written here: the repo's, renamed, on the soak's blocks."""
        prefect = [sys.executable, "-m", "prefect"]
        setup = self._cli([sys.executable, "-m", "posttrain", "prefect-setup", "--no-kubernetes-pool"])
        if setup.returncode != 0:
            raise RuntimeError(f"posttrain prefect-setup failed: {setup.stdout}{setup.stderr}"[-2000:])
        self._cli([*prefect, "work-pool", "create", self.name, "--type", "process"])
        run_settings = {"base_model": str(self.base_model), "dataset": str(self.dataset),
                        "shared_dir": str(self.shared), "cluster": self.cluster("nightly"),
                        "store": f"posttrain-object-store/{self.name}"}
        pool = {"name": self.name, "job_variables": {"env": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                                                             "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}}}
        params = {
            "nightly": {**run_settings, "run_name": f"{self.name}-nightly", "inference": self.gateways["staging"].block,
                        "reward_funcs": REWARDS},
            "grpo": {**run_settings, "run_name": f"{self.name}-grpo", "inference": self.gateways["rollouts"].block,
                     "cluster": self.cluster("grpo")},
            "promote": {"production": self.gateways["production"].block, "staging": self.gateways["staging"].block,
                        "store": run_settings["store"], "tokenizer": str(self.base_model),
                        "shared_dir": str(self.shared)},
            "rollback": {"production": self.gateways["production"].block, "store": run_settings["store"]},
        }
        deployments = [{"name": f"{self.name}-{kind}", "entrypoint": entry, "tags": ["posttrain", "soak", kind, self.name],
                        "enforce_parameter_schema": True, "parameters": params[kind], "work_pool": pool,
                        **({"concurrency_limit": {"limit": 1, "collision_strategy": "ENQUEUE"}}
                           if kind != "rollback" else {})}
                       for kind, (_, entry) in FLOWS.items()]
        spec = {"name": self.name, "prefect-version": "3.9.1", "build": None, "push": None,
                "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
                "deployments": deployments}
        path = self.rec.logs / "prefect-soak.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        deploy = self._cli([*prefect, "--no-prompt", "deploy", "--all", "--prefect-file", str(path)])
        if deploy.returncode != 0:
            raise RuntimeError(f"prefect deploy failed: {deploy.stdout}{deploy.stderr}"[-2000:])

    # ----- the end -----
    def final_gateway_state(self) -> dict[str, dict]:
        """Each gateway's /health, and its /metrics saved under logs/, at quiesce."""
        out = {}
        for role, gw in self.gateways.items():
            final: dict = {"health": None, "metrics_file": None}
            for path, key in (("/health", "health"), ("/metrics", "metrics_file")):
                request = urllib.request.Request(f"{gw.url}{path}", headers={"Authorization": f"Bearer {self.token}"})
                try:
                    with urllib.request.urlopen(request, timeout=10) as r:
                        body = r.read()
                except OSError as e:
                    final[key] = None if key == "metrics_file" else {"error": str(e)}
                    continue
                if key == "health":
                    final["health"] = json.loads(body)
                else:
                    (self.rec.logs / f"{role}-metrics.txt").write_bytes(body)
                    final["metrics_file"] = f"logs/{role}-metrics.txt"
            out[role] = final
        return out

    def stop(self) -> None:
        for proc in [self.recover, self.worker, *(gw.process for gw in self.gateways.values())]:
            if proc is not None:
                proc.stop()
        if self.store is not None:
            (self.rec.logs / "proxy-counters.json").write_text(json.dumps(self.store.counters(), indent=2))
            self.store.stop()
        self._unmount_spool()

    def _unmount_spool(self) -> None:
        """The runs' folders outlive the tmpfs: copied to disk, unmounted, and put back at the same path."""
        if self.spool.get("kind") != "tmpfs":
            return
        saved = self.root / "shared.saved"
        subprocess.run(["cp", "-a", f"{self.shared}/.", str(saved)], check=False)
        umount = subprocess.run(["umount", str(self.shared)], capture_output=True, text=True)
        if umount.returncode != 0:
            umount = subprocess.run(["umount", "-l", str(self.shared)], capture_output=True, text=True)
        if umount.returncode == 0:
            shutil.rmtree(self.shared, ignore_errors=True)
            saved.rename(self.shared)
        else:
            self.rec.log(f"umount {self.shared} failed ({umount.stderr.strip()}); the copy is in {saved}")
