"""Check 4, ``rounds``: each GRPO round trained once, in order, on rollouts within the staleness bound.

A GRPO run's folder (found under the soak's ``run_dirs``: a folder with ``rounds/``) holds, per
round r, ``rounds/<r:04d>/rollouts.jsonl`` and ``ready.json`` (the hand-over: the file's SHA-256
and the policy versions that sampled it), and the trainer's ``policy/checkpoint-<N>/`` with its
``trainer_state.json`` (version, the rollouts file and SHA-256 it trained on, how many rollouts it
used and dropped as stale); posttrain/trainer/rounds.py and docs/prefect.md say how. Read here as
plain files and JSON, and checked:

- every checkpoint names the rollouts of one round of its run, the file it trained on is the one
  handed (same SHA-256 now, in the marker and in the state);
- each round is trained by one checkpoint (not twice), the rounds trained are 0..R without a gap
  (none skipped), and round r trains version v0 + r (v0 the same for every round of the run);
- no rollout newer than the version trained; the rollouts used are exactly those at most
  ``max_staleness`` versions older (``soak.json``), the dropped ones exactly the rest: a rollout
  beyond the bound entering the loss is a violation;
- a round is sampled only from versions v0 + r - k .. v0 + r (the flow's promise: never from a
  policy more than k versions old), and each rollout's version is one its marker names;
- rollouts of one policy version name snapshots of one training step.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

from posttrain.testing.soak.check_context import Context
from posttrain.testing.soak.check_model import CheckResult, finite
from posttrain.testing.soak.check_store import IDENTITY_STEP_RE

ROUND_RE = re.compile(r"\d{4}")
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")


def grpo_run_folders(run_dirs: list[Path], depth: int = 3) -> list[Path]:
    found: list[Path] = []

    def walk(p: Path, d: int) -> None:
        if (p / "rounds").is_dir():
            found.append(p)
            return
        if d <= 0:
            return
        try:
            children = sorted(c for c in p.iterdir() if c.is_dir() and not c.name.startswith("."))
        except OSError:
            return
        for c in children:
            walk(c, d - 1)

    for r in run_dirs:
        walk(Path(r), depth)
    return sorted(set(found))


def check_rounds(ctx: Context) -> CheckResult:
    res = CheckResult("rounds")
    k = ctx.soak.meta.get("max_staleness")
    if not finite(k) or k < 0 or int(k) != k:
        res.bad(f"soak.json: max_staleness {k!r} is not a whole number >= 0; rounds not checked")
        return res
    for folder in grpo_run_folders(ctx.soak.run_dirs()):
        _check_run(res, folder, int(k))
    if not res.items:
        res.notes.append("no GRPO round was found under run_dirs")
    return res


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _check_run(res: CheckResult, run: Path, k: int) -> None:
    name = run.name
    ready = {int(d.name): _json(d / "ready.json") for d in (run / "rounds").iterdir()
             if d.is_dir() and ROUND_RE.fullmatch(d.name) and (d / "ready.json").exists()}
    trained: dict[int, list[str]] = {}
    v0s: set[int] = set()
    for ck in sorted((run / "policy").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])
                     if CHECKPOINT_RE.fullmatch(p.name) else -1):
        state = _json(ck / "trainer_state.json")
        if not CHECKPOINT_RE.fullmatch(ck.name) or state is None or "rollouts" not in state:
            continue  # not a complete round checkpoint (a nightly's, or being written)
        res.items += 1
        where = f"run {name}: {ck.name}"
        folder = Path(state["rollouts"]).parent
        if not ROUND_RE.fullmatch(folder.name):
            res.bad(f"{where} trained on {state['rollouts']}, not a round's rollouts")
            continue
        r = int(folder.name)
        trained.setdefault(r, []).append(ck.name)
        version = state.get("policy_version")
        if not finite(version):
            res.bad(f"{where}: policy_version {version!r}")
            continue
        v0s.add(int(version) - r - 1)
        handed = ready.get(r)
        local = run / "rounds" / folder.name / "rollouts.jsonl"
        sha = _sha256(local)
        if handed is None:
            res.bad(f"{where} trained round {r}, which was never handed (no ready.json)")
        elif not (state.get("rollouts_sha256") == handed.get("rollouts_sha256") == sha):
            res.bad(f"{where} trained round {r} on rollouts {str(state.get('rollouts_sha256'))[:12]}, the marker "
                    f"handed {str(handed.get('rollouts_sha256'))[:12]}, the file is {str(sha)[:12]} now")
            continue
        _check_staleness(res, where, local, int(version) - 1, k, state)
    for r, cks in sorted(trained.items()):
        if len(cks) > 1:
            res.bad(f"run {name}: round {r} was trained {len(cks)} times ({', '.join(cks)})")
    if trained:
        skipped = sorted(set(range(max(trained) + 1)) - set(trained))
        if skipped:
            res.bad(f"run {name}: round(s) {skipped} skipped (rounds up to {max(trained)} were trained)")
    if len(v0s) > 1:
        res.bad(f"run {name}: its rounds train versions that do not follow the round numbers (v0 {sorted(v0s)})")
    v0 = min(v0s) if v0s else 0
    for r, marker in sorted(ready.items()):
        res.items += 1
        _check_sampling(res, f"run {name}: round {r}", run / "rounds" / f"{r:04d}", marker, v0 + r, k)


def _rollouts(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def _check_staleness(res: CheckResult, where: str, path: Path, version: int, k: int, state: dict) -> None:
    try:
        rows = _rollouts(path)
    except (OSError, ValueError) as e:
        res.bad(f"{where}: its rollouts cannot be read ({e})")
        return
    versions = [r.get("policy_version") for r in rows]
    if not finite(*versions):
        res.bad(f"{where}: a rollout's policy_version is not a number")
        return
    future = sorted({v for v in versions if v > version})
    fresh = sum(1 for v in versions if version - k <= v <= version)
    stale = sum(1 for v in versions if v < version - k)
    used, dropped = state.get("rollouts_used"), state.get("rollouts_dropped_stale")
    if future:
        res.bad(f"{where}: rollouts of versions {future} trained by version {version}, older than them")
    if not finite(used, dropped):
        res.bad(f"{where}: rollouts_used {used!r} / rollouts_dropped_stale {dropped!r}")
    elif used > fresh:
        res.bad(f"{where}: {used} rollouts entered the loss, only {fresh} are within max_staleness {k} of "
                f"version {version} ({stale} are older)")
    elif (used, dropped) != (fresh, stale):
        res.bad(f"{where}: used {used} and dropped {dropped} rollouts; within the bound are {fresh}, beyond {stale}")


def _check_sampling(res: CheckResult, where: str, folder: Path, marker: dict | None, trains: int, k: int) -> None:
    if marker is None:
        res.bad(f"{where}: ready.json is not a round marker")
        return
    versions = marker.get("policy_versions") or []
    if not versions or not finite(*versions):
        res.bad(f"{where}: ready.json names policy versions {versions!r}")
        return
    out = [v for v in versions if not trains - k <= v <= trains]
    if out:
        res.bad(f"{where} (trains version {trains}) was sampled from version(s) {out}, beyond max_staleness {k}")
    try:
        rows = _rollouts(folder / "rollouts.jsonl")
    except (OSError, ValueError) as e:
        res.bad(f"{where}: its rollouts cannot be read ({e})")
        return
    named = Counter(r.get("policy_version") for r in rows if r.get("policy_version") not in versions)
    if named:
        res.bad(f"{where}: rollouts of versions {sorted(named, key=str)} its marker does not name ({versions})")
    steps: dict[object, set[str]] = {}
    for r in rows:
        m = IDENTITY_STEP_RE.fullmatch(r.get("snapshot_identity") or "")
        if m:
            steps.setdefault(r.get("policy_version"), set()).add(m.group(1))
    for v, s in sorted(steps.items(), key=lambda kv: str(kv[0])):
        if len(s) > 1:
            res.bad(f"{where}: rollouts of version {v} name snapshots of steps {sorted(s)}")
