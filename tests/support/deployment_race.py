"""Promotion, rollback and gc racing on one folder store, in real processes.

Production is a ``FileLoader``: a hot-load writes the identity production serves into a file
(after ``delay`` seconds; identities in ``fail_on`` fail; with ``hold`` it waits until that file
exists, and with ``hang_on`` it never returns for that identity, so the process can be killed
mid-switch). Promotions reuse stored evals (``seed_evals``), so no staging server is needed: the
candidate and champion "evaluations" are what the test wrote. ``SlowStore`` is the real folder
store with a pause before some reads or deletes, to place one process's step inside another's.

The workers run in fresh processes (``spawn``) and write what happened as JSON to ``out``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from pathlib import Path

from posttrain.inference.contract import HotLoadFailed, HotLoadResult
from posttrain.storage import LocalStore

K = 16  # eval prompts: above any min_prompts the gate allows by default
SAMPLES = 2
REWARD = "posttrain.testing.rewards:reference_match"
CTX = multiprocessing.get_context("spawn")


class FileLoader:
    def __init__(self, served: Path, *, delay: float = 0.0, fail_on: tuple[str, ...] = (), hold: Path | None = None,
                 hang_on: tuple[str, ...] = ()):
        self.served, self.delay, self.fail_on, self.hold, self.hang_on = Path(served), delay, fail_on, hold, hang_on

    def hot_load(self, identity: str, *, base_identity: str | None = None, publish_full=None) -> HotLoadResult:  # noqa: ANN001
        t0 = time.monotonic()
        while self.hold is not None and not self.hold.exists():
            time.sleep(0.02)
        while identity in self.hang_on:  # killed here, between the record and the switch
            time.sleep(0.1)
        time.sleep(self.delay)
        if identity in self.fail_on:
            raise HotLoadFailed(f"hot-load of {identity} FAILED: replica r0 in ERROR")
        tmp = self.served.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(identity)
        os.replace(tmp, self.served)
        with open(self.served.with_suffix(".log"), "a") as log:
            log.write(identity + "\n")
        return HotLoadResult(operation_id=f"op-{os.getpid()}-{time.time_ns()}", identity=identity,
                             snapshot_type="SNAPSHOT_TYPE_INCREMENTAL" if base_identity else "SNAPSHOT_TYPE_FULL",
                             state="HOT_LOAD_STATE_COMPLETED", seconds=time.monotonic() - t0, replicas=[], attempts=1)


def served(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


class SlowStore(LocalStore):
    """The folder store, pausing once before a read of a key containing ``read_pause`` (touching
    ``reached``, then until the file ``gate`` exists and ``pause`` seconds have passed) and before
    each delete (``delete_pause`` seconds)."""

    def __init__(self, root: Path, *, read_pause: str | None = None, gate: Path | None = None, pause: float = 0.0,
                 reached: Path | None = None, delete_pause: float = 0.0):
        super().__init__(root)
        self.read_pause, self.gate, self.pause, self.delete_pause = read_pause, gate, pause, delete_pause
        self.reached = Path(reached) if reached else None

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        if self.read_pause is not None and self.read_pause in key:
            self.read_pause = None  # once
            if self.reached is not None:
                self.reached.touch()
            end = time.monotonic() + self.pause
            while (self.gate is not None and not self.gate.exists()) or time.monotonic() < end:
                time.sleep(0.02)
        return super().get_bytes(key)

    def delete(self, keys) -> None:  # noqa: ANN001
        time.sleep(self.delete_pause)
        super().delete(keys)


def rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"question {i}"}], "id": f"q{i:02d}"} for i in range(K)]


def settings_and_gate():  # noqa: ANN201
    from posttrain.promote.decision import GateConfig
    from posttrain.promote.evaluate import EvalSettings

    settings = EvalSettings(samples_per_prompt=SAMPLES, max_tokens=4, temperature=1e-6, reward_funcs=[REWARD])
    return settings, GateConfig(samples_per_prompt=SAMPLES)


def decision(candidate: str, champion: str | None, accepted: bool):  # noqa: ANN201 - a Decision
    """A gate's decision as a history record holds it, for records a test writes itself."""
    from posttrain.promote.decision import Decision

    return Decision(accepted=accepted, reason="accepted: test" if accepted else "refused: test", rule="superiority",
                    margin=0.0, confidence=0.95, bootstrap_samples=10_000, seed=0, candidate=candidate,
                    champion=champion, prompts=16, samples_per_prompt=2)


def seed_evals(store, scores: dict[str, float], dataset_digest: str = "d" * 64) -> None:  # noqa: ANN001
    """Stored evals: ``identity`` scores about ``scores[identity]`` on every prompt."""
    from posttrain.promote.evaluate import EvalResult, EvalStore, eval_digest

    settings, _ = settings_and_gate()
    digest = eval_digest(dataset_digest, settings, K)
    for identity, score in scores.items():
        rewards = {f"q{i:02d}": [score, max(0.0, score - 0.01 * (i % 3))] for i in range(K)}
        mean = sum(sum(v) / len(v) for v in rewards.values()) / K
        EvalStore(store).put(EvalResult(identity=identity, digest=digest, rewards=rewards, mean=mean))


def _outcome(out: Path, fn, go: str | None = None) -> None:  # noqa: ANN001
    """Run ``fn`` (once the file ``go`` exists, when given: workers imported, they start together)."""
    if go is not None:
        out.with_suffix(".ready").touch()
        while not Path(go).exists():
            time.sleep(0.005)
    try:
        result = fn()
        data = {"ok": True, **result}
    except Exception as e:  # noqa: BLE001 - the test reads what happened
        data = {"ok": False, "error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    out.write_text(json.dumps(data))


def _production(name: str, served_file: str, loader: dict):  # noqa: ANN202
    from posttrain.promote.promoter import Deployment

    return Deployment(name, FileLoader(Path(served_file), **loader))


def promote_worker(root: str, candidate: str, run: str, served_file: str, out: str, loader: dict | None = None,
                   store_kw: dict | None = None, lease_ttl: float = 120.0, go: str | None = None) -> None:
    from posttrain.promote.promoter import Deployment, promote

    def run_it() -> dict:
        settings, gate = settings_and_gate()
        store = SlowStore(Path(root), **(store_kw or {}))
        staging = Deployment("staging", FileLoader(Path(served_file).with_name("staging")))
        done = promote(store=store, candidate=candidate, run=run, gate=gate, settings=settings, rows=rows(),
                       dataset_digest="d" * 64, tokenizer=None, staging=staging,
                       production=_production("prod", served_file, loader or {}), lease_ttl=lease_ttl, gc_wait=60)
        return {"promoted": done.promoted, "seq": done.record.seq if done.record else None}

    _outcome(Path(out), run_it, go)


def rollback_worker(root: str, to: str, run: str | None, served_file: str, out: str, loader: dict | None = None,
                    lease_ttl: float = 120.0, go: str | None = None) -> None:
    from posttrain.promote.promoter import rollback

    def run_it() -> dict:
        done = rollback(store=LocalStore(Path(root)), production=_production("prod", served_file, loader or {}),
                        to=to, run=run, lease_ttl=lease_ttl, gc_wait=60)
        return {"identity": done.record.identity, "seq": done.record.seq, "again": done.recorded_before}

    _outcome(Path(out), run_it, go)


def gc_worker(root: str, out: str, keep_runs: int, plan_pause: float = 0.0, delete_pause: float = 0.0) -> None:
    from posttrain.publish.gc import GcConfig, plan_gc, run_gc

    def go() -> dict:
        store = SlowStore(Path(root), delete_pause=delete_pause)
        plan = plan_gc(store, GcConfig(keep_runs=keep_runs))
        time.sleep(plan_pause)
        result = run_gc(store, plan)
        return {"deleted": [d.identity for d in result.deleted], "skipped": result.skipped}

    _outcome(Path(out), go)


def start(target, *args, **kw) -> multiprocessing.Process:  # noqa: ANN001
    p = CTX.Process(target=target, args=args, kwargs=kw)
    p.start()
    return p


def release_together(go: Path, outs: list[Path], timeout: float = 120.0) -> None:
    """Once every worker writing to ``outs`` has started and imported, let them all go at once."""
    end = time.monotonic() + timeout
    while not all(out.with_suffix(".ready").exists() for out in outs):
        assert time.monotonic() < end, "the workers did not start"
        time.sleep(0.01)
    go.touch()


def result(out: Path, proc: multiprocessing.Process, timeout: float = 120.0) -> dict:
    proc.join(timeout)
    assert proc.exitcode == 0, f"worker exit code {proc.exitcode}"
    return json.loads(out.read_text())
