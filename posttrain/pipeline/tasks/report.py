"""Artifacts: per-round tables, checkpoint-watch progress, cluster log links, the reward curve."""

from __future__ import annotations

import base64

from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact


def artifact_key(*parts: object) -> str:
    """Artifact keys: lowercase letters, digits and dashes."""
    text = "-".join(str(p) for p in parts).lower()
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def round_table(run_name: str, rows: list[dict]) -> None:
    create_table_artifact(rows, key=artifact_key(run_name, "rounds"),
                          description="GRPO rounds: rewards, samples, policy version, delta size, publish and "
                          "hot-load seconds")


def log_links(run_name: str, job_id: str, log_path: str | None, backend: str) -> None:
    md = f"### Training job `{job_id}` ({backend})\n\n"
    md += f"- log: `{log_path}`\n" if log_path else "- log: not available\n"
    if backend == "slurm":
        md += f"- `squeue -j {job_id}`, `sacct -j {job_id}`, `scancel {job_id}`\n"
    elif backend == "k8s":
        md += f"- `kubectl logs -f job/{job_id}`, `kubectl delete job {job_id}`\n"
    create_markdown_artifact(md, key=artifact_key(run_name, "training-job"), description="Where the training logs are")


def reward_curve_svg(means: list[float], stds: list[float]) -> str:
    """A small self-contained SVG line chart of the mean reward per round, with ±1 std band."""
    w, h, pad = 480, 240, 40
    n = max(len(means), 1)
    lo = min((m - s for m, s in zip(means, stds, strict=True)), default=0.0)
    hi = max((m + s for m, s in zip(means, stds, strict=True)), default=1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5

    def xy(i: int, v: float) -> tuple[float, float]:
        x = pad + (w - 2 * pad) * (i / (n - 1) if n > 1 else 0.5)
        return x, h - pad - (h - 2 * pad) * (v - lo) / (hi - lo)

    line = " ".join("%.1f,%.1f" % xy(i, m) for i, m in enumerate(means))
    band = [xy(i, m + s) for i, (m, s) in enumerate(zip(means, stds, strict=True))]
    band += [xy(i, m - s) for i, (m, s) in reversed(list(enumerate(zip(means, stds, strict=True))))]
    poly = " ".join("%.1f,%.1f" % p for p in band)
    labels = "".join(f'<text x="{xy(i, lo)[0]:.1f}" y="{h - pad + 16}" font-size="11" text-anchor="middle">{i}</text>'
                     for i in range(len(means)))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">'
            f'<rect width="{w}" height="{h}" fill="white"/>'
            f'<polygon points="{poly}" fill="#9ecae1" opacity="0.5"/>'
            f'<polyline points="{line}" fill="none" stroke="#08519c" stroke-width="2"/>'
            f'<text x="{pad}" y="20" font-size="13">mean reward per round ({lo:.2f} .. {hi:.2f})</text>'
            f"{labels}</svg>")


def reward_curve(run_name: str, means: list[float], stds: list[float]) -> str:
    svg = reward_curve_svg(means, stds)
    url = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
    create_image_artifact(image_url=url, key=artifact_key(run_name, "reward-curve"),
                          description="Mean reward per GRPO round")
    return svg
