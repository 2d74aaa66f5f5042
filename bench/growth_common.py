"""What every dimension of ``bench/growth.py`` shares: the machine line, tables, plots, growth ratios.

A dimension module measures (a function returning plain rows, so that a test can call it at the
smallest size and check what does not depend on the machine's speed) and prints; this module only
formats. Plots need matplotlib (the ``bench`` extra); without it a dimension still prints its table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
DOCS_PLOTS = ROOT / "docs" / "growth"
RESULTS = ROOT / "bench" / ".data" / "growth"


def machine() -> str:
    """One line: cores, memory, CPU model and the load average, printed above every table."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kib = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                       if x.startswith("MemTotal"))
        mem = f"{mem_kib / (1 << 20):.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        mem = "RAM unknown"
    return f"{os.cpu_count()} cores ({model}), {mem}, {platform.system()} {platform.release()}; load {loadavg()}"


def loadavg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def ratio(num: float, den: float) -> float:
    """num / den, refusing NaN and a zero or negative denominator (a growth figure must mean something)."""
    if math.isnan(num) or math.isnan(den):
        raise ValueError(f"growth ratio of NaN: {num} / {den}")
    if den <= 0:
        raise ValueError(f"growth ratio against {den}: the baseline must be positive")
    return num / den


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (printed, and pasted into docs/benchmarks.md as it is)."""
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(header)]
    lines = [f"{title}", "", "| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def plot(name: str, title: str, xlabel: str, series: dict[str, tuple[Sequence[float], Sequence[float]]],
         ylabel: str, *, logx: bool = False, out_dir: Path = DOCS_PLOTS) -> Path | None:
    """A PNG line plot ``out_dir/name.png`` of ``{label: (xs, ys)}``; None (and a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed (pip install -e '.[bench]'); {name}.png not drawn", flush=True)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    # no timestamp in the PNG, so an unchanged plot is an unchanged file
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    print(f"plot: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", flush=True)
    return path


def save(name: str, payload: dict, out_dir: Path = RESULTS) -> Path:
    """The raw rows as JSON beside the data (bench/.data/growth/<name>.json), for the docs' figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "at": time.strftime("%Y-%m-%d %H:%M:%S"), **payload},
                               indent=1, default=str))
    return path


def ensure_bucket(client, name: str) -> None:  # noqa: ANN001 - a boto3 S3 client
    """Create bucket ``name`` unless it exists: the growth tests share the suite's SeaweedFS and may
    create it at the same moment (the loser's CreateBucket answers BucketAlreadyOwnedByYou)."""
    try:
        client.create_bucket(Bucket=name)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


class Measured(NamedTuple):
    seconds: float  # wall
    rss_mib: float  # the child's own peak (wait4's ru_maxrss), so this process's memory does not count
    cpu_s: float  # user + system
    stdout: str  # with capture=True, else ""


# ru_maxrss of a child keeps the high-water mark of the process it was started from (Linux carries the
# old memory's peak over at exec, and Python's subprocess starts children with vfork): a test worker that
# had once held 600 MiB made every command it ran "peak" at 600 MiB. So a fresh interpreter without
# site-packages (about 10 MiB: the floor of every figure) starts the command and reports the command's
# own wall time and wait4 figures.
_LAUNCHER = """
import json, os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        os.write(2, f"{sys.argv[2]}: {e}\\n".encode())
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump([time.perf_counter() - t0, usage.ru_maxrss, usage.ru_utime + usage.ru_stime], f)
sys.exit(min(abs(os.waitstatus_to_exitcode(status)), 255))
"""


def run_measured(cmd: list[str], *, env: dict | None = None, cwd: Path = ROOT, capture: bool = False) -> Measured:
    """Run a command in a process of its own and measure it (wall, its own peak RSS, CPU); a failure stops
    the benchmark with its stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".json") as figures:
        proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, figures.name, *cmd], cwd=cwd, env=env,
                              stdout=out if capture else subprocess.DEVNULL, stderr=err, check=False)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read().decode()[-4000:]}")
        secs, maxrss_kib, cpu_s = json.load(figures)
        out.seek(0)
        return Measured(secs, maxrss_kib / 1024, cpu_s, out.read().decode())


def python() -> str:
    return sys.executable
