"""posttrain stage / posttrain watch, and python -m posttrain.trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from posttrain.cli import main
from posttrain.datasets.toy import toy_prompt_rows, write_toy_jsonl


def _run(args, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120, **kw)


def test_light_modules_do_not_import_torch():
    code = (
        "import sys, posttrain.runs.watch, posttrain.datasets.staging, posttrain.trainer, posttrain.rewards, "
        "posttrain.cli.train; bad = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    assert _run(["-c", code]).returncode == 0


def test_stage_command(tmp_path, capsys, write_jsonl):
    source = write_toy_jsonl(tmp_path / "toy.jsonl", n=3)
    assert main(["stage", str(source), "--dest", str(tmp_path / "store")]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("manifest.json") and "staged: 3 rows" in err
    assert main(["stage", str(source), "--dest", str(tmp_path / "store"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["already_staged"] is True
    bad = write_jsonl(tmp_path / "bad.jsonl", [toy_prompt_rows(1)[0], "oops"])
    assert main(["stage", str(bad), "--dest", str(tmp_path / "store")]) == 2
    assert "line 2: not valid JSON" in capsys.readouterr().err


def test_watch_command_once(tmp_path, capsys, make_checkpoint):
    out = tmp_path / "out"
    make_checkpoint(out, 3)
    make_checkpoint(out, 1)
    cursor = tmp_path / "cursor.json"
    assert main(["watch", str(out), "--cursor", str(cursor), "--once"]) == 0
    assert [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()] == [1, 3]
    make_checkpoint(out, 5)
    (out / "done").touch()
    assert main(["watch", str(out), "--cursor", str(cursor), "--done-file", str(out / "done"), "--poll", "0.05"]) == 0
    assert [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()] == [5]


def test_trainer_module_runs_a_step_and_rejects_bad_configs(tiny_model_dir, tmp_path):
    from posttrain.rollouts.format import Rollout, write_rollouts

    rollouts = [
        Rollout(
            prompt_ids=[1, 5, 6],
            completion_ids=[7, 8, 2],
            logprobs=[-6.0, -6.1, -6.2],
            reward=float(i % 2),
            group_id=i // 2,
            policy_version=0,
        )
        for i in range(4)
    ]
    path = write_rollouts(tmp_path / "r.jsonl", rollouts)
    config = tmp_path / "step.yaml"
    config.write_text(
        f"mode: step\nmodel_name_or_path: {tiny_model_dir}\noutput_dir: {tmp_path / 'out'}\n"
        f"rollouts: {path}\nlearning_rate: 1.0e-3\nuse_cpu: true\n"
    )
    results = tmp_path / "out" / ".posttrain" / "step-1.results.jsonl"
    done = _run(["-m", "posttrain.trainer", str(config), "--result-file", str(results)])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["completed"] and result["checkpoint"] == str(tmp_path / "out" / "checkpoint-1")
    # the attempt's timeline beside the results: process start <= loaded <= step <= save <= end
    from posttrain.trainer.timeline import read_timeline, timeline_file_for

    events = [json.loads(line)["event"] for line in open(timeline_file_for(results))]
    assert events == ["start", "loaded", "step_begin", "step_end", "save_begin", "save_end", "end"], events
    (attempt,) = read_timeline(timeline_file_for(results))
    assert attempt.finished and attempt.start <= attempt.loaded <= attempt.saves[0][0] <= attempt.ended

    config.write_text("mode: step\nmodel_name_or_path: m\noutput_dir: relative\n")
    bad = _run(["-m", "posttrain.trainer", str(config)])
    assert bad.returncode == 2
    assert "output_dir: must be an absolute path" in bad.stderr
