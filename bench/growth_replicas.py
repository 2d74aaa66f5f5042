"""How cost grows with replicas: a delta hot-load into 1, 2, 4 and 8 reference servers from one store.

A synthetic bf16 decoder (Llama tensor names; default 256 MiB) and the same one Adam-like step
later are published to a SeaweedFS of our own (a full snapshot, then a delta). N reference servers
(``posttrain serve``, a process each, its own deployment and work dir) are brought onto the full
snapshot, then the delta is hot-loaded into all N at once, as N pipelines' ``hot_load`` tasks would
(one ``CoreWeaveHotLoader`` per deployment, in threads). Wall time runs from the first create to
the last replica answering a completion stamped with the new identity.

Bytes read from the store are counted exactly: each server reaches SeaweedFS through a counting
HTTP proxy of its own (``FaultProxy`` with no faults, counting the response bodies it relays), so
the bytes of each replica and their sum are known, against the delta's stored size.

Who shares what: a reference server is one deployment holding its own model, so each fetches,
rebuilds and loads the delta itself (nothing is fetched once for several servers); the vLLM and
SGLang gateways fetch once per deployment and their replicas load the one rebuilt folder
(docs/serving.md). Here the N servers share the machine's cores, its disk and the one store.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from growth_common import ROOT, ensure_bucket, loadavg, machine, plot, python, ratio, save, table

MiB = 1 << 20
TOKEN = "growth-replicas-token"
BUCKET = "growth"
WALL_GOAL = 1.2  # the goal: wall at 8 replicas <= 1.2x one replica's
OVERHEAD_BYTES = 64 * 1024  # per replica, beyond the delta's bytes: index and checksums read by describe/plan


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8], help="numbers of reference servers")
    p.add_argument("--mib", type=int, default=256, help="size of the synthetic checkpoint (MiB)")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of the Adam-like step of the delta")


# ---------------------------------------------------------------------- the checkpoints
def write_pair(base: Path, new: Path, total_bytes: int, lr: float, seed: int = 1) -> tuple[Path, Path]:
    """A Llama-shaped bf16 checkpoint transformers can load (no tokenizer) and the same one Adam-like
    step later; small sizes get a narrow model and a small vocabulary so that a test stays fast."""
    import numpy as np

    from posttrain.testing.synthetic import adam_update, model_shapes, to_bf16_bits, write_checkpoint

    hidden, vocab = (1024, 32768) if total_bytes >= 128 * MiB else (512, 8192) if total_bytes >= 32 * MiB else (128, 2048)
    shapes = model_shapes(total_bytes, hidden, vocab) + [("model.norm.weight", (hidden,))]
    rng = np.random.default_rng(seed)
    base_t: dict[str, tuple[str, np.ndarray]] = {}
    new_t: dict[str, tuple[str, np.ndarray]] = {}
    for name, shape in shapes:
        master = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if name.endswith("norm.weight"):
            master += np.float32(1.0)
        base_t[name] = ("BF16", to_bf16_bits(master))
        master += np.float32(lr) * adam_update(rng, shape, 4)
        new_t[name] = ("BF16", to_bf16_bits(master))
    heads = 8  # head_dim = hidden / 8; 2 key-value heads match k_proj's hidden / 4 rows
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": 3 * hidden, "num_attention_heads": heads, "num_key_value_heads": heads // 4,
              "num_hidden_layers": sum(1 for n, _ in shapes if n.endswith("q_proj.weight")), "vocab_size": vocab,
              "max_position_embeddings": 512, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    for folder, tensors in ((base, base_t), (new, new_t)):
        write_checkpoint(folder, tensors, config=config)
    return base, new


def publish_pair(endpoint: str, prefix: str, base: Path, new: Path, work: Path) -> tuple[str, str, int]:
    """The base as a full snapshot, the new checkpoint as a delta against it; (full, delta, delta bytes)."""
    from posttrain.chain.policy import ChainPolicy
    from posttrain.publish import PublishConfig, Publisher
    from posttrain.storage import S3Store, S3StoreConfig

    store = S3Store(S3StoreConfig(bucket=BUCKET, prefix=prefix, endpoint_url=endpoint, region="us-east-1",
                                  access_key_id="bench", secret_access_key="bench", addressing_style="path"))
    publisher = Publisher(store, PublishConfig(run="growth", work_dir=work, async_publish=False, policy=ChainPolicy()))
    try:
        publisher.submit(base)
        publisher.submit(new)
        full, delta = publisher.published[-2:]
        assert (full.kind, delta.kind) == ("full", "delta"), (full.kind, delta.kind)
        return full.identity, delta.identity, delta.stored_bytes
    finally:
        publisher.close()
        store.close()


# ---------------------------------------------------------------------- counting the store's reads
class CountingProxy:
    """A ``FaultProxy`` that fails nothing and counts the body bytes it relays from the store."""

    def __init__(self, upstream: str = "http://127.0.0.1:9") -> None:
        from posttrain.testing.faultproxy import FaultProxy, _Handler

        class Counting(_Handler):
            def _relay(self, response) -> None:  # noqa: ANN001 - http.client.HTTPResponse
                read = response.read

                def counted(amt: int | None = None) -> bytes:
                    data = read(amt)
                    self.server.proxy.counter.add(len(data))  # type: ignore[attr-defined]
                    return data

                response.read = counted
                super()._relay(response)

        self.proxy = FaultProxy(upstream, fault_rate=0.0)
        self.proxy._server.RequestHandlerClass = Counting  # the same proxy, bodies counted
        self.proxy.counter = self.counter = ByteCounter()  # type: ignore[attr-defined]
        self.proxy.start()
        self.url = self.proxy.url

    def point_at(self, upstream: str) -> None:
        """Forward to ``upstream`` from now on (the servers boot while the store starts)."""
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.proxy.upstream = (host, int(port))

    def stop(self) -> None:
        self.proxy.stop()


@dataclass
class ByteCounter:
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def take(self) -> int:
        """The bytes counted since the last take."""
        with self._lock:
            n, self.bytes = self.bytes, 0
        return n


# ---------------------------------------------------------------------- the reference servers
@dataclass
class Replica:
    name: str
    url: str
    proc: subprocess.Popen
    proxy: CountingProxy
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(i: int, prefix: str, model: Path, work: Path) -> Replica:
    """``posttrain serve`` on the base checkpoint, reaching the store through a counting proxy of its own
    (pointed at the store once it is up: a server reads it only when asked to hot-load)."""
    proxy = CountingProxy()
    port, name = free_port(), f"dep-replica-{i}"
    log = work / f"{name}.log"
    env = {**os.environ, "CW_API_TOKEN": TOKEN, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [python(), "-m", "posttrain", "serve", "--model", str(model), "--deployment-id", name, "--store",
           f"s3://{BUCKET}", "--prefix", prefix, "--s3-endpoint-url", proxy.url, "--s3-region", "us-east-1",
           "--work-dir", str(work / name), "--port", str(port), "--device", "cpu", "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Replica(name, f"http://127.0.0.1:{port}", proc, proxy, log)


def wait_up(replica: Replica, timeout: float = 300) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            raise SystemExit(f"{replica.name} exited:\n{replica.log.read_text()[-3000:]}")
        try:
            if requests.get(f"{replica.url}/health", headers=_auth(), timeout=5).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{replica.name} not up after {timeout:.0f}s:\n{replica.log.read_text()[-3000:]}")


def stop_replica(replica: Replica) -> None:
    replica.proc.terminate()
    try:
        replica.proc.wait(30)
    except subprocess.TimeoutExpired:
        replica.proc.kill()
        replica.proc.wait()
    replica.proxy.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def served_identity(replica: Replica) -> str | None:
    """The identity stamped on a completion the replica answers now (read back, not remembered)."""
    import requests

    model = requests.get(f"{replica.url}/v1/models", headers=_auth(), timeout=30).json()["data"][0]["id"]
    reply = requests.post(f"{replica.url}/v1/completions", headers=_auth(), timeout=120,
                          json={"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0})
    reply.raise_for_status()
    return reply.json()["snapshot_identity"]


def hot_load(replica: Replica, identity: str, base: str | None, read_back: bool = True) -> dict:
    """One deployment's hot-load as the pipeline's task makes it, then the identity read back (a
    completion makes the server read its digests back at its next probe: only where it is measured)."""
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

    t0 = time.perf_counter()
    with CoreWeaveHotLoader(HotLoadConfig(api_url=replica.url, deployment_id=replica.name, token=TOKEN,
                                          poll_interval=0.05, timeout=1800)) as loader:
        result = loader.hot_load(identity, base_identity=base)
        stages = loader.get_operation(result.operation_id)["status"].get("stageSeconds", {})
    served = served_identity(replica) if read_back else None
    return dict(seconds=time.perf_counter() - t0, served=served, fell_back=result.fell_back, **stages)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hot_load_all(replicas: list[Replica], identity: str, base: str | None,
                 read_back: bool = True) -> tuple[float, float, list[dict]]:
    """Wall seconds until every replica answers stamped with ``identity``, this process's CPU seconds
    (the proxies and the clients), and each replica's figures (its CPU seconds among them)."""
    for r in replicas:
        r.proxy.counter.take()
    cpu0 = [cpu_seconds(r.proc.pid) for r in replicas]
    here0 = time.process_time()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(replicas)) as pool:
        results = list(pool.map(lambda r: hot_load(r, identity, base, read_back), replicas))
    wall = time.perf_counter() - t0
    here = time.process_time() - here0
    for r, res, c0 in zip(replicas, results, cpu0, strict=True):
        res["store_bytes"] = r.proxy.counter.take()
        res["cpu_s"] = cpu_seconds(r.proc.pid) - c0
    return wall, here, results


# ---------------------------------------------------------------------- the measurement
def measure_replicas(counts: list[int], mib: float, lr: float = 1e-6, endpoint: str | None = None) -> list[dict]:
    """One row per number of replicas: wall seconds of the delta hot-load into all of them, bytes read
    from the store (all, and each replica's), the delta's stored bytes, and each replica's stages.

    Servers are started once (as many as the largest count); for each count, the first N are put on
    the full snapshot (not measured), then the delta is hot-loaded into them (measured)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from publish_hotload import boto_client, s3_endpoint

    work = Path(tempfile.mkdtemp(prefix="posttrain-growth-replicas-"))
    rows: list[dict] = []
    try:
        with ExitStack() as stack:
            prefix = f"replicas-{uuid.uuid4().hex[:8]}"
            base, new = write_pair(work / "checkpoint-1", work / "checkpoint-2", int(mib * MiB), lr)
            t0 = time.perf_counter()
            replicas = [start_replica(i, prefix, base, work) for i in range(max(counts))]
            for r in replicas:
                stack.callback(stop_replica, r)
            if endpoint is None:  # started while the servers boot
                endpoint = stack.enter_context(s3_endpoint(work))
            for r in replicas:
                r.proxy.point_at(endpoint)
            client = boto_client(endpoint)
            ensure_bucket(client, BUCKET)
            full, delta, delta_bytes = publish_pair(endpoint, prefix, base, new, work / "publish")
            shutil.rmtree(new)
            for r in replicas:
                wait_up(r)
            print(f"  {len(replicas)} servers up in {time.perf_counter() - t0:.1f}s", flush=True)
            for n in sorted(counts):
                print(f"  {n} replica(s): onto the full snapshot ...", flush=True)
                hot_load_all(replicas[:n], full, None, read_back=False)
                wall, bench_cpu, per = hot_load_all(replicas[:n], delta, full)
                rows.append(_row(n, mib, wall, per, delta, delta_bytes) | {"bench_cpu_s": bench_cpu})
                print(f"  {n} replica(s): delta hot-load {wall:.2f}s, {rows[-1]['store_bytes'] / MiB:.1f} MiB "
                      f"read from the store", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _row(n: int, mib: float, wall: float, per: list[dict], delta: str, delta_bytes: int) -> dict:
    def mean(key: str) -> float:
        return sum(p.get(key, math.nan) for p in per) / len(per)

    return dict(replicas=n, mib=mib, wall_s=wall, store_bytes=sum(p["store_bytes"] for p in per),
                delta_bytes=delta_bytes, per_replica_bytes=[p["store_bytes"] for p in per],
                all_serve_delta=all(p["served"] == delta for p in per), fell_back=any(p["fell_back"] for p in per),
                fetch_s=mean("fetch"), apply_s=mean("apply"), load_s=mean("load"), slowest_s=max(p["seconds"] for p in per),
                server_cpu_s=sum(p["cpu_s"] for p in per), cores=os.cpu_count() or 1, per_replica=per)


def cpu_floor(row: dict) -> float:
    """The least wall the servers' CPU work allows on this machine: their CPU seconds over the cores."""
    return row["server_cpu_s"] / row["cores"]


def verdicts(rows: list[dict]) -> list[list[object]]:
    """Store bytes per replica against the delta (each reference server must read it once), wall at the
    largest count against one replica's (goal <= 1.2x), and what bounds that wall (the cores' share)."""
    one = min(rows, key=lambda r: r["replicas"])
    top = max(rows, key=lambda r: r["replicas"])
    worst = max(max(r["per_replica_bytes"]) for r in rows)
    bytes_ok = worst <= top["delta_bytes"] + OVERHEAD_BYTES and all(r["all_serve_delta"] for r in rows)
    grow = ratio(top["wall_s"], one["wall_s"])
    cpu_grow = ratio(top["server_cpu_s"] / top["replicas"], one["server_cpu_s"] / one["replicas"])
    return [
        ["store bytes grow only where each replica must read them",
         f"each replica read at most {ratio(worst, top['delta_bytes']):.3f}x the delta; all together "
         f"{ratio(top['store_bytes'], top['delta_bytes']):.2f}x at {top['replicas']}", "met" if bytes_ok else "NOT met"],
        [f"wall at {top['replicas']} <= {WALL_GOAL}x one replica's", f"{grow:.2f}x",
         "met" if grow <= WALL_GOAL else "NOT met"],
        ["servers' CPU per replica flat (the work each must do)", f"{cpu_grow:.2f}x at {top['replicas']}",
         "met" if cpu_grow <= WALL_GOAL else "NOT met"],
        [f"wall at {top['replicas']} against the cores' floor (servers' CPU s / {top['cores']} cores)",
         f"{top['wall_s']:.2f} s against {cpu_floor(top):.2f} s ({ratio(top['wall_s'], cpu_floor(top)):.2f}x)", "-"],
    ]


def main(args: argparse.Namespace) -> None:
    print(machine(), flush=True)
    rows = measure_replicas(args.replicas, args.mib, args.lr)
    one = min(rows, key=lambda r: r["replicas"])
    print()
    table(f"Delta hot-load into N reference servers, {args.mib} MiB checkpoint, delta "
          f"{one['delta_bytes'] / MiB:.1f} MiB ({machine()})",
          ["replicas", "wall s", "wall / 1 replica", "store MiB read", "store bytes / delta", "per replica / delta",
           "servers' CPU s", "CPU s / replica", "cores' floor s", "fetch s", "apply s", "load s", "all serve delta"],
          [[r["replicas"], r["wall_s"], f"{ratio(r['wall_s'], one['wall_s']):.2f}x", f"{r['store_bytes'] / MiB:.1f}",
            f"{ratio(r['store_bytes'], r['delta_bytes']):.2f}x",
            f"{ratio(max(r['per_replica_bytes']), r['delta_bytes']):.3f}x", r["server_cpu_s"],
            r["server_cpu_s"] / r["replicas"], cpu_floor(r), r["fetch_s"], r["apply_s"], r["load_s"],
            "yes" if r["all_serve_delta"] else "NO"] for r in rows])
    print()
    table("Goals", ["goal", "measured", "verdict"], verdicts(rows))
    print("\nEach reference server is its own deployment: it fetches the delta itself (no server reads it for "
          "another), rebuilds it and loads it; the N servers share this machine's cores, disk and the one store "
          "over loopback. fetch/apply/load: the servers' own stage seconds (means over the replicas); cores' floor: "
          "the servers' CPU seconds over the cores, the least wall their work allows here.")
    xs = [r["replicas"] for r in rows]
    plot("replicas", "Delta hot-load into N reference servers", "replicas",
         {"wall / 1 replica": (xs, [ratio(r["wall_s"], one["wall_s"]) for r in rows]),
          "store bytes / delta": (xs, [ratio(r["store_bytes"], r["delta_bytes"]) for r in rows]),
          "servers' CPU s / 1 replica's": (xs, [ratio(r["server_cpu_s"], one["server_cpu_s"]) for r in rows])},
         "ratio", logx=True)
    save("replicas", {"rows": rows, "mib": args.mib, "load_after": loadavg()})
