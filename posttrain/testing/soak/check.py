"""The soak's independent checker (issue 35, section 4): it reads what the system stored and what the
soak's client recorded, and names every violation it finds.

Inputs, and nothing else: the soak folder the driver writes (``soak.json``, ``schedule.jsonl``,
``faults.jsonl``, ``runs.jsonl``, ``operator.jsonl``, ``replies.jsonl``; docs/reliability.md),
the object store read with boto3 directly (``check_store``), the run folders on disk, the Prefect
API over plain HTTP for the runs' states, the gateways' ``/health`` and ``/metrics``, the process
table (``/proc``) and Slurm's ``squeue``. The product's own verdicts (its ``verify``, its gc plan,
its history reader, a run's own report) are never consulted: each check re-derives what it needs
from the stored bytes, re-implementing the formats from docs/delta-format.md, docs/layout.md,
docs/retention.md and docs/promotion.md. What is reused: third-party libraries only (boto3,
xxhash, zstandard, numpy, safetensors' dtype names, and torch + transformers to run the tiny
model for the replies); no posttrain module is imported.

The checks, one function each (``CHECKS``), each returning a ``CheckResult`` (items checked,
violations, notes):

1. ``snapshots``: every stored snapshot verifies, rebuilds and names itself; the ledger's entries
   are all there; no orphan objects (``check_snapshots``);
2. ``histories``: every promotion history is consistent, every production gateway serves its
   history's champion after quiescence, the operator's rollbacks are in the history
   (``check_histories``);
3. ``replies``: every 200 reply is the greedy answer of the identity it is stamped with
   (``check_replies``);
4. ``rounds``: no round trained twice or skipped, none trained on rollouts beyond the staleness
   bound (``check_rounds``);
5. ``runs``: every run ended, Completed or killed by a fault it could not survive (``check_runs``);
6. ``leftovers``: no job, process or store lease left behind; the gateways' metrics agree with
   the histories (``check_leftovers``).

Every numeric comparison refuses NaN (``finite``). ``live=False`` skips what needs the running
system (Prefect, gateways, processes, Slurm): those items are reported as skipped, never as passed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from posttrain.testing.soak.check_context import Context
from posttrain.testing.soak.check_history import check_histories
from posttrain.testing.soak.check_leftovers import check_leftovers
from posttrain.testing.soak.check_model import CheckResult, Soak
from posttrain.testing.soak.check_replies import check_replies
from posttrain.testing.soak.check_rounds import check_rounds
from posttrain.testing.soak.check_runs import check_runs
from posttrain.testing.soak.check_snapshots import check_snapshots

CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "snapshots": check_snapshots, "histories": check_histories, "replies": check_replies,
    "rounds": check_rounds, "runs": check_runs, "leftovers": check_leftovers,
}


def run_checks(soak_dir: str | Path, *, live: bool = True, store_client=None,  # noqa: ANN001
               only: list[str] | None = None) -> list[CheckResult]:
    """Every check (or those named in ``only``) on the soak folder ``soak_dir``."""
    soak = Soak.read(soak_dir)
    ctx = Context(soak, live=live, store_client=store_client)
    results = [CheckResult("soak folder", items=1 + sum(len(v) for v in soak.records.values()),
                           violations=list(soak.problems))]
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        try:
            results.append(check(ctx))
        except Exception as e:  # noqa: BLE001 - a check that cannot run is a violation, not a pass
            results.append(CheckResult(name, violations=[f"the check could not run: {type(e).__name__}: {e}"]))
    return results


def table(results: list[CheckResult]) -> str:
    """The table of checks, then every violation, note and skipped item under its check."""
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  {'items':>7}  {'violations':>10}  {'skipped':>7}"]
    lines += [f"{r.name:<{width}}  {r.items:>7}  {len(r.violations):>10}  {len(r.skipped):>7}" for r in results]
    total = sum(len(r.violations) for r in results)
    lines.append(f"{'total':<{width}}  {sum(r.items for r in results):>7}  {total:>10}  "
                 f"{sum(len(r.skipped) for r in results):>7}")
    for r in results:
        for label, rows in (("VIOLATION", r.violations), ("skipped", r.skipped), ("note", r.notes)):
            lines += [f"[{r.name}] {label}: {row}" for row in rows]
    return "\n".join(lines)
