"""Artifacts: per-round tables, checkpoint-watch progress, cluster log links, the reward curve,
where the training metrics are (TensorBoard's log folder and command).

Keys come from the user-given run name (not the flow run's suffixed one), so each kind has one
key per deployment run name and Prefect keeps a version per night. Within one flow run each kind
is one artifact, updated in place: every round, and every retry of the flow run."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
)
from prefect.runtime import flow_run

from posttrain.words import plural


def artifact_key(*parts: object) -> str:
    """Artifact keys: lowercase letters, digits and dashes."""
    text = "-".join(str(p) for p in parts).lower()
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def _existing(key: str, kind: str) -> UUID | None:
    """This flow run's artifact of ``key`` and type ``kind``, if an earlier round or attempt made one."""
    run_id = flow_run.id
    if not run_id:
        return None
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key={"any_": [key]}, type={"any_": [kind]},
                                           flow_run_id={"any_": [UUID(str(run_id))]}),
            limit=1)
    return found[0].id if found else None


def _upsert(key: str, kind: str, data: object, description: str, create: Callable[[], UUID]) -> UUID:
    """Update this flow run's artifact of ``key`` in place, or create it (a new version of the key)."""
    artifact_id = _existing(key, kind)
    if artifact_id is None:
        return create()
    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    with get_client(sync_client=True) as client:
        client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description))
    return artifact_id


def short_identity(identity: str) -> str:
    """A snapshot identity as a table shows it: the first 8 hex digits of its hash
    (``step-00000003-9f2c41d0...`` shows ``9f2c41d0``)."""
    return identity.rsplit("-", 1)[-1][:8]


# The rounds table's columns (the GRPO flow's row keys) and their headers. Prefect's artifact page
# gives a table about 840 px in a 1400 px window and cuts off what is wider: short headers, the
# snapshot's short form (a full identity alone took 420 px) and no "kind" (the size column says
# "full" for a full snapshot).
ROUND_COLUMNS = {"round": "round", "samples": "samples", "reward mean": "reward", "reward std": "std",
                 "shard spread": "spread", "snapshot": "snapshot", "delta % of full": "% of full",
                 "publish s": "publish s", "hot-load s": "hot-load s", "round s": "round s"}
# Asynchronous rounds (max_staleness > 0) add, after the round, the policy version its rollouts were
# sampled from, its staleness (round - version) and the seconds the round waited for the trainer (in
# synchronous rounds the version is the round's own, offset by the base's step, and nothing waits).
# To fit the width they show publish + hot-load as one column and leave out the shards' spread
# (both are in the flow's result and the terminal's table).
ASYNC_COLUMNS = {"round": "round", "policy version": "policy", "staleness": "stale", "wait s": "wait s",
                 "samples": "samples", "reward mean": "reward", "reward std": "std", "snapshot": "snapshot",
                 "delta % of full": "% of full", "serve s": "serve s", "round s": "round s"}


def _cell(row: dict, key: str) -> object:
    if key == "snapshot":
        return short_identity(row[key])
    if key == "serve s":  # none where the round samples a policy an earlier round published and hot-loaded
        publish, hotload = row.get("publish s"), row.get("hot-load s")
        return None if publish is None or hotload is None else round(publish + hotload, 2)
    return row.get(key)


def round_table_rows(rows: list[dict], asynchronous: bool = False) -> list[dict]:
    """The rounds table as the artifact shows it (``asynchronous``: max_staleness > 0); the flow's
    result keeps the full rows."""
    columns = ASYNC_COLUMNS if asynchronous else ROUND_COLUMNS
    return [{header: _cell(row, key) for key, header in columns.items()} for row in rows]


def round_table_description(asynchronous: bool, trainer=None) -> str:
    """What the rounds table's columns hold. Only in synchronous rounds is a round's policy the one
    every earlier round trained."""
    if asynchronous:
        head = ("GRPO rounds, asynchronous: policy is the policy version the round's rollouts were sampled "
                "from, stale the versions it is behind the round (at most max_staleness), wait s the seconds "
                "the round waited for the trainer; ")
        times = ("serve s the publish + hot-load seconds (none where the round samples the policy an earlier "
                 "round published), round s the round's seconds; the shards' spread is in the run's result")
    else:
        head = "GRPO rounds, each sampled from the policy every earlier round trained (round 0: the base model): "
        times = "publish, hot-load and round seconds"
    return (head + "reward mean and std over the round's samples" + ("" if asynchronous else
            ", the std of the shards' means") + ", the snapshot published (its hash's first 8 hex digits; the "
            "full identity is in the run's logs, events and result), its size (a delta's % of the full weights, "
            "or full), " + times + tensorboard_line(trainer))


# Prefect replaces an artifact's data whole on every update: a live table of every round would
# write bytes in proportion to the round number each round (30 KB a round at round 200, twice: the
# artifact and its collection's copy). While the run goes it shows the latest rounds; the flow writes
# the whole table once, after the last round.
LIVE_TABLE_ROWS = 20
# The reward curve's points at most: a longer run's rounds are averaged in as many equal bins (the
# 480 px chart holds no more), so the live curve's bytes stop growing with the round number too.
CURVE_POINTS = 60


def round_table(run_name: str, rows: list[dict], trainer=None, *, asynchronous: bool = False,
                whole: bool = False) -> None:
    """The rounds table (``asynchronous``: max_staleness > 0, with the policy, staleness and wait
    columns); with ``trainer`` (the round's TrainerConfig), its description says where the training
    curves are (``tensorboard_line``). The latest ``LIVE_TABLE_ROWS`` rounds unless ``whole``."""
    key = artifact_key(run_name, "rounds")
    description = round_table_description(asynchronous, trainer)
    live = rows if whole else rows[-LIVE_TABLE_ROWS:]
    if len(live) < len(rows):
        description = (f"The latest {len(live)} of {len(rows)} rounds so far (every round once the run ends). "
                       + description)
    shown = round_table_rows(live, asynchronous)
    _upsert(key, "table", json.dumps(shown), description,
            lambda: create_table_artifact(shown, key=key, description=description))


def snapshots_table(run_name: str, rows: list[dict], trainer=None) -> None:
    key = artifact_key(run_name, "snapshots")  # the run name says nightly already: no nightly-nightly-snapshots
    description = "Checkpoints of the nightly run: snapshot, size, publish and hot-load times" + tensorboard_line(trainer)
    _upsert(key, "table", json.dumps(rows), description,
            lambda: create_table_artifact(rows, key=key, description=description))


def goodput_table(run_name: str, goodput) -> None:
    """``goodput``: a ``posttrain.runs.goodput.Goodput``; one row per category, then the wall time."""
    key = artifact_key(run_name, "goodput")
    rows = goodput.rows() + [{"category": "wall", "seconds": round(goodput.wall_s, 2), "% of wall": 100.0}]
    description = (f"Goodput {100 * goodput.goodput:.1f}%: the run's wall time by category (docs/goodput.md); "
                   f"{plural(goodput.attempts, 'trainer attempt')}, {plural(goodput.restarts, 'restart')}, "
                   f"{goodput.lost_redone_s:.1f} s of work redone")
    _upsert(key, "table", json.dumps(rows), description,
            lambda: create_table_artifact(rows, key=key, description=description))


def gc_table(run_name: str, rows: list[dict], description: str) -> None:
    """The snapshots the run's gc deleted (run, identity, kind, step, bytes), in deletion order."""
    key = artifact_key(run_name, "gc")
    _upsert(key, "table", json.dumps(rows), description,
            lambda: create_table_artifact(rows, key=key, description=description))


def progress(run_name: str) -> UUID:
    """The flow run's progress artifact: found again on a retry (which goes on from where it is)."""
    key = artifact_key(run_name, "training-progress")
    description = "Checkpoints published and hot-loaded, by training step"
    return _existing(key, "progress") or create_progress_artifact(0.0, key=key, description=description)


def log_links(run_name: str, job_id: str, log_path: str | None, backend: str) -> None:
    md = f"### Training job `{job_id}` ({backend})\n\n"
    md += f"- log: `{log_path}`\n" if log_path else "- log: not available\n"
    if backend == "slurm":
        md += f"- `squeue -j {job_id}`, `sacct -j {job_id}`, `scancel {job_id}`\n"
    elif backend == "k8s":
        md += f"- `kubectl logs -f job/{job_id}`, `kubectl delete job {job_id}`\n"
    key = artifact_key(run_name, "training-job")
    description = "Where the training logs are"
    _upsert(key, "markdown", md, description,
            lambda: create_markdown_artifact(md, key=key, description=description))


def tensorboard_line(trainer) -> str:
    """A sentence for an artifact's description: where the run's TensorBoard curves are ("" without them)."""
    if trainer is None or "tensorboard" not in trainer.report_to:
        return ""
    return f". Training curves (loss, reward, ...): tensorboard --logdir {trainer.tensorboard_dir}"


def training_metrics_markdown(trainer) -> str:
    """Where a run's training metrics go: each tracker of ``report_to``; for TensorBoard, its log
    folder and the command that shows it."""
    trackers = trainer.trackers
    if not trackers:
        return ("### Training metrics\n\nreport_to is none: the metrics are only in the checkpoints' "
                "`trainer_state.json` (and the flow's result).\n")
    md = "### Training metrics\n\n"
    per_point = ("one point per round (step = the round)" if trainer.mode == "step"
                 else f"one point every {trainer.logging_steps} optimizer step(s)")
    md += f"Trackers: {', '.join(f'`{t}`' for t in trackers)}; {per_point}"
    md += f", run name `{trainer.run_name}`.\n\n" if trainer.run_name else ".\n\n"
    if "tensorboard" in trackers:
        logdir = trainer.tensorboard_dir
        md += (f"- TensorBoard event files: `{logdir}`\n"
               f"- view them: `tensorboard --logdir {logdir}` (then http://localhost:6006), "
               f"or every run of the store's shared folder: `tensorboard --logdir {logdir.parent.parent}`\n")
    others = [t for t in trackers if t != "tensorboard"]
    if others:
        md += f"- {', '.join(others)}: look for the run `{trainer.run_name}` in their own UI\n"
    return md


def training_metrics(run_name: str, trainer) -> None:
    """The run's "where are the training curves" artifact (``training_metrics_markdown``)."""
    md = training_metrics_markdown(trainer)
    key = artifact_key(run_name, "training-metrics")
    description = "Where the training metrics (loss, reward, gradient norm) are"
    _upsert(key, "markdown", md, description,
            lambda: create_markdown_artifact(md, key=key, description=description))


def size_column(snapshot) -> str:
    """A snapshot's size as the tables show it: a delta's stored bytes as a % of the full weights;
    a full snapshot is just "full"."""
    if snapshot.kind == "full":
        return "full"
    return f"{100 * snapshot.stored_bytes / max(snapshot.raw_bytes, 1):.2f}"


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values from at or below ``lo`` to at or above ``hi``."""
    raw = (hi - lo) / max(count - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 10) for k in range(first, last + 1)]


def curve_points(means: list[float], stds: list[float], most: int) -> list[tuple[float, float, float]]:
    """(round, mean, std) per round, or of at most ``most`` equal bins of consecutive rounds (their
    mean round, mean of the means, mean std)."""
    n = len(means)
    if n <= most:
        return [(float(i), m, s) for i, (m, s) in enumerate(zip(means, stds, strict=True))]
    bins = [range(j * n // most, (j + 1) * n // most) for j in range(most)]
    return [(sum(b) / len(b), sum(means[i] for i in b) / len(b), sum(stds[i] for i in b) / len(b)) for b in bins]


def reward_curve_svg(means: list[float], stds: list[float], max_points: int | None = None) -> str:
    """A small self-contained SVG line chart of the mean reward per round, with a ±1 std band and
    labelled axes: round on x, reward on y, tick labels on both; at most ``max_points`` points
    (default ``CURVE_POINTS``: longer runs are binned)."""
    w, h, left, right, top, bottom = 480, 260, 56, 16, 28, 44
    n = max(len(means), 1)
    most = CURVE_POINTS if max_points is None else max_points
    points = curve_points(means, stds, most)
    lo = min((m - s for _, m, s in points), default=0.0)
    hi = max((m + s for _, m, s in points), default=1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    ticks = _ticks(lo, hi)
    lo, hi = ticks[0], ticks[-1]

    def xy(i: float, v: float) -> tuple[float, float]:
        x = left + (w - left - right) * (i / (n - 1) if n > 1 else 0.5)
        return x, h - bottom - (h - top - bottom) * (v - lo) / (hi - lo)

    line = " ".join("%.1f,%.1f" % xy(i, m) for i, m, _ in points)
    band = [xy(i, m + s) for i, m, s in points] + [xy(i, m - s) for i, m, s in reversed(points)]
    poly = " ".join("%.1f,%.1f" % p for p in band)
    x0, y0, x1 = left, h - bottom, w - right
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2:.0f}" y="18" font-size="13" text-anchor="middle">mean reward per round (±1 std)</text>',
             f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{y0}" stroke="black"/>',
             f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>']
    for t in ticks:
        y = xy(0, t)[1]
        parts.append(f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text class="ytick" x="{x0 - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{t:g}</text>')
    step = max(1, math.ceil(len(means) / min(10, most)))  # no more round labels than points
    for i in range(0, len(means), step):
        x = xy(i, lo)[0]
        parts.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + 4}" stroke="black"/>'
                     f'<text class="xtick" x="{x:.1f}" y="{y0 + 16}" font-size="11" text-anchor="middle">{i}</text>')
    parts += [f'<text class="xlabel" x="{(x0 + x1) / 2:.0f}" y="{h - 8}" font-size="12" text-anchor="middle">round</text>',
              f'<text class="ylabel" x="14" y="{(top + y0) / 2:.0f}" font-size="12" text-anchor="middle" '
              f'transform="rotate(-90 14 {(top + y0) / 2:.0f})">reward</text>']
    if means:
        parts += [f'<polygon points="{poly}" fill="#9ecae1" opacity="0.5"/>',
                  f'<polyline points="{line}" fill="none" stroke="#08519c" stroke-width="2"/>']
        parts += [f'<circle cx="{xy(i, m)[0]:.1f}" cy="{xy(i, m)[1]:.1f}" r="2.5" fill="#08519c"/>'
                  for i, m, _ in points]
    parts.append("</svg>")
    return "".join(parts)


def reward_curve(run_name: str, means: list[float], stds: list[float], rounds: int) -> str:
    """The reward curve so far as a keyed artifact, updated in place each round (of ``rounds``). Markdown
    with the SVG inline: an image artifact's page would also print the whole data URL, running off the page."""
    svg = reward_curve_svg(means, stds)
    url = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
    key = artifact_key(run_name, "reward-curve")
    description = f"Mean reward per GRPO round ({reward_curve_progress(len(means), rounds)})"
    markdown = f"![mean reward per round, with one standard deviation]({url})\n"  # the card shows the description
    _upsert(key, "markdown", markdown, description,
            lambda: create_markdown_artifact(markdown, key=key, description=description))
    return svg


def reward_curve_progress(done: int, rounds: int) -> str:
    """How much of the run the curve shows: "2 of 4 rounds so far", then "4 rounds" once all are in."""
    return plural(rounds, "round") if done >= rounds else f"{done} of {plural(rounds, 'round')} so far"


def comparison_svg(decision) -> str:
    """A small SVG of the gate's comparison (``decision``: a ``posttrain.promote.Decision``): each side's
    mean reward as a dot with its interval, on one reward axis."""
    sides = [(label, mean, iv) for label, mean, iv in (
        ("champion", decision.champion_mean, decision.champion_interval),
        ("candidate", decision.candidate_mean, decision.candidate_interval)) if mean is not None]
    w, row, left, right, top = 480, 34, 90, 24, 30
    h = top + row * max(len(sides), 1) + 40
    values = [v for _, m, iv in sides for v in (m, *(iv or ()))] or [0.0, 1.0]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    ticks = _ticks(lo, hi)
    lo, hi = ticks[0], ticks[-1]

    def x(v: float) -> float:
        return left + (w - left - right) * (v - lo) / (hi - lo)

    verdict = "accepted" if decision.accepted else "refused"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2:.0f}" y="18" font-size="13" text-anchor="middle">mean reward, '
             f'{decision.confidence:.0%} intervals: {verdict}</text>']
    axis = top + row * max(len(sides), 1)
    parts.append(f'<line x1="{left}" y1="{axis}" x2="{w - right}" y2="{axis}" stroke="black"/>')
    for t in ticks:
        parts.append(f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{axis + 4}" stroke="#ddd"/>'
                     f'<text x="{x(t):.1f}" y="{axis + 16}" font-size="11" text-anchor="middle">{t:g}</text>')
    for i, (label, mean, iv) in enumerate(sides):
        y = top + row * i + row / 2
        color = "#08519c" if label == "candidate" else "#636363"
        parts.append(f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="12" text-anchor="end">{label}</text>')
        if iv:
            parts.append(f'<line x1="{x(iv[0]):.1f}" y1="{y:.1f}" x2="{x(iv[1]):.1f}" y2="{y:.1f}" '
                         f'stroke="{color}" stroke-width="2"/>')
        parts.append(f'<circle cx="{x(mean):.1f}" cy="{y:.1f}" r="4" fill="{color}"/>')
    parts.append(f'<text x="{(left + w - right) / 2:.0f}" y="{h - 6}" font-size="12" text-anchor="middle">'
                 'reward</text></svg>')
    return "".join(parts)


def promotion_report(key: str, production: str, promotion) -> None:
    """The gate's comparison as a markdown artifact: the decision, its table and a plot."""
    d = promotion.decision
    svg = comparison_svg(d)
    url = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
    record = f"history record #{promotion.record.seq}" if promotion.record else "nothing new recorded"
    reason = promotion.record.reason if promotion.record else d.reason
    markdown = (f"### {'Promoted' if d.accepted else 'Refused'}: `{d.candidate}` for {production}\n\n"
                f"{reason}\n\n{d.markdown_table(reason=False)}\n\n![the two means with their intervals]({url})\n\n"
                f"Champion before: `{d.champion or 'none'}`; {record}.\n")
    description = f"Eval gate of {production}: {'accepted' if d.accepted else 'refused'} {d.candidate}"
    create_markdown_artifact(markdown, key=artifact_key(key, "promotion"), description=description)
