"""Promotion, rollback and gc racing against real reference servers on one folder store.

The servers (staging and production) are ``tests.support.serving.start_server`` ones; each
operation is a process of its own: the promotion is the engine (``promote_worker``, spawned, with
the hot-load clients of both servers and staging's completions), rollback and gc are the
``posttrain`` CLI (``start_cli``, subprocesses). Each has imported what it needs before it waits
for its start file, so that a test places the starts, not the imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.deployment_race import _outcome
from tests.support.serving import TOKEN

# posttrain's own entry point (the console script calls it), started once the file argv[2] exists
_CLI = """
import pathlib, sys, time
import posttrain.cli, posttrain.cli.gc, posttrain.cli.rollback  # imported before the start, as the engine is
import posttrain.inference.hotload, posttrain.promote.promoter, posttrain.publish.gc
ready, go, delay = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.005)
time.sleep(delay)
sys.exit(posttrain.cli.main(sys.argv[4:]))
"""


@dataclass
class Cli:
    """A ``posttrain`` command in a subprocess; its output goes to ``<out>.stdout`` and ``<out>.stderr``."""

    proc: subprocess.Popen
    out: Path

    @property
    def ready(self) -> Path:
        return self.out.with_suffix(".ready")

    def result(self, timeout: float = 180.0) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once it ended."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"posttrain {' '.join(self.proc.args[6:])} did not end in {timeout:g}s") from None
        return rc, self.out.with_suffix(".stdout").read_text(), self.out.with_suffix(".stderr").read_text()


def start_cli(argv: list[str], out: Path, go: Path, delay: float = 0.0) -> Cli:
    """``posttrain <argv>`` in a subprocess, run ``delay`` seconds after the file ``go`` exists
    (the hot-load API token in CW_API_TOKEN)."""
    env = {**os.environ, "CW_API_TOKEN": TOKEN}
    with open(out.with_suffix(".stdout"), "w") as stdout, open(out.with_suffix(".stderr"), "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", _CLI, str(out.with_suffix(".ready")), str(go), str(delay),
                                 *argv], stdout=stdout, stderr=stderr, env=env)
    return Cli(proc, out)


def promote_worker(root: str, candidate: str, run: str, urls: dict[str, str], model_dir: str, rows: list[dict],
                   out: str, go: str, delay: float = 0.0) -> None:
    """Promote ``candidate`` of the folder store ``root`` from staging (``urls["staging"]``) to
    production (``urls["prod"]``), evaluating both sides on staging: the engine, as the promote
    flow runs it. Writes what happened to ``out`` (JSON)."""
    from transformers import AutoTokenizer

    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
    from posttrain.promote.decision import GateConfig
    from posttrain.promote.evaluate import EvalSettings
    from posttrain.promote.promoter import Deployment, promote
    from posttrain.rollouts.client import CompletionsClient, CompletionsConfig
    from posttrain.storage import LocalStore
    from tests.support.promotion import greedy_eval

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loaders = {name: CoreWeaveHotLoader(HotLoadConfig(api_url=url, deployment_id=name, token=TOKEN,
                                                      poll_interval=0.05, timeout=120)) for name, url in urls.items()}

    def completions() -> CompletionsClient:
        return CompletionsClient(CompletionsConfig(gateway_url=urls["staging"], model="tiny", token=TOKEN))

    def run_it() -> dict:
        time.sleep(delay)
        settings = EvalSettings(**greedy_eval())
        done = promote(store=LocalStore(Path(root)), candidate=candidate, run=run, rows=rows, dataset_digest="d" * 64,
                       gate=GateConfig(samples_per_prompt=settings.samples_per_prompt), settings=settings,
                       tokenizer=tokenizer, staging=Deployment("staging", loaders["staging"], completions),
                       production=Deployment("prod", loaders["prod"]))
        return {"promoted": done.promoted, "kind": done.record.kind if done.record else None,
                "seq": done.record.seq if done.record else None, "reason": done.decision.reason}

    try:
        _outcome(Path(out), run_it, go)
    finally:
        for loader in loaders.values():
            loader.close()
