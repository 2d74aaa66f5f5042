"""The artifacts' pieces that need no server: the reward curve SVG, the size column, the rounds table."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from types import SimpleNamespace

from posttrain.pipeline.tasks.report import (
    reward_curve_progress,
    reward_curve_svg,
    round_table_description,
    round_table_rows,
    size_column,
)

SVG = "{http://www.w3.org/2000/svg}"


def _texts(svg: str, cls: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text for t in root.iter(f"{SVG}text") if t.get("class") == cls]


def test_reward_curve_svg_has_labelled_axes_and_ticks():
    svg = reward_curve_svg([0.1, 0.35, 0.5, 0.62], [0.05, 0.1, 0.08, 0.04])
    assert _texts(svg, "xlabel") == ["round"]
    assert _texts(svg, "ylabel") == ["reward"]
    assert _texts(svg, "xtick") == ["0", "1", "2", "3"]
    yticks = [float(t) for t in _texts(svg, "ytick")]
    assert len(yticks) >= 3 and yticks == sorted(yticks)
    assert yticks[0] <= 0.1 and yticks[-1] >= 0.6  # the ticks span the data
    assert "<polyline" in svg and "href" not in svg  # self-contained: nothing loaded from elsewhere
    assert len(svg) < 5000


def test_reward_curve_svg_of_one_flat_round_and_of_none():
    one = reward_curve_svg([0.5], [0.0])
    assert _texts(one, "xtick") == ["0"] and len(_texts(one, "ytick")) >= 2
    none = reward_curve_svg([], [])
    ET.fromstring(none)
    assert _texts(none, "xlabel") == ["round"] and "<polyline" not in none


def test_the_reward_curve_says_so_far_only_while_rounds_are_left():
    assert reward_curve_progress(2, 4) == "2 of 4 rounds so far"
    assert reward_curve_progress(4, 4) == "4 rounds"  # a finished run: no "(4 rounds so far)"
    assert reward_curve_progress(1, 1) == "1 round"


def test_size_column_is_a_ratio_for_deltas_only():
    full = SimpleNamespace(kind="full", stored_bytes=1013, raw_bytes=1000)
    delta = SimpleNamespace(kind="delta", stored_bytes=120, raw_bytes=1000)
    assert size_column(full) == "full"
    assert re.fullmatch(r"12\.00", size_column(delta))


def round_row(r: int, identity: str) -> dict:
    """A row of the GRPO flow's rounds (its result's ``rounds``)."""
    return {"round": r, "policy version": r, "samples": 16, "reward mean": 0.4375, "reward std": 0.4961,
            "shard spread": 0.0625, "snapshot": identity, "kind": "delta" if r else "full",
            "delta % of full": "12.34" if r else "full", "publish s": 1.23, "hot-load s": 0.45, "round s": 12.34}


def test_the_rounds_table_shows_a_short_snapshot_and_every_other_value():
    identity = "step-00000001-" + "9f2c41d0" + "ab" * 12
    (shown,) = round_table_rows([round_row(1, identity)])
    assert shown["snapshot"] == "9f2c41d0"
    assert list(shown) == ["round", "samples", "reward", "std", "spread", "snapshot", "% of full", "publish s",
                           "hot-load s", "round s"]
    assert [v for k, v in shown.items() if k != "snapshot"] == [1, 16, 0.4375, 0.4961, 0.0625, "12.34", 1.23, 0.45,
                                                                12.34]


def test_asynchronous_rounds_show_their_policy_version_staleness_and_wait():
    """max_staleness > 0: round 3 sampled from policy 2 after waiting 1.5 s, round 4 from the same policy
    (published and hot-loaded once: no serve time)."""
    identity = "step-00000002-" + "9f2c41d0" + "ab" * 12
    rows = [round_row(3, identity) | {"policy version": 2, "staleness": 1, "wait s": 1.5},
            round_row(4, identity) | {"policy version": 2, "staleness": 2, "wait s": 0.0, "publish s": None,
                                      "hot-load s": None}]
    shown = round_table_rows(rows, asynchronous=True)
    assert list(shown[0]) == ["round", "policy", "stale", "wait s", "samples", "reward", "std", "snapshot",
                              "% of full", "serve s", "round s"]
    assert [(x["round"], x["policy"], x["stale"], x["wait s"], x["serve s"]) for x in shown] == [
        (3, 2, 1, 1.5, 1.68), (4, 2, 2, 0.0, None)]
    described = round_table_description(asynchronous=True)
    assert "policy version the round's rollouts were sampled from" in described
    assert "the round is its rollouts' policy version" not in described
    # Synchronous rounds keep their table; their description says where a round's policy comes from.
    assert "policy" not in round_table_rows(rows)[0]
    assert "the policy every earlier round trained" in round_table_description(asynchronous=False)


def test_the_training_metrics_artifact_names_the_tensorboard_folder_and_command():
    from posttrain.pipeline.tasks.report import tensorboard_line, training_metrics_markdown
    from posttrain.trainer.config import TrainerConfig

    step = TrainerConfig(mode="step", model_name_or_path="/m", output_dir="/shared/runs/g-1/policy",
                         rollouts="/r.jsonl", run_name="g-1", logging_dir="/shared/runs/g-1/tensorboard")
    md = training_metrics_markdown(step)
    assert "`tensorboard --logdir /shared/runs/g-1/tensorboard`" in md and "one point per round" in md
    assert "tensorboard --logdir /shared/runs`" in md  # every run of the shared folder
    assert tensorboard_line(step).endswith("tensorboard --logdir /shared/runs/g-1/tensorboard")
    # without logging_dir: the folder beside output_dir, as in the flows
    assert "/shared/runs/g-1/tensorboard" in tensorboard_line(step.model_copy(update={"logging_dir": None}))
    none = step.model_copy(update={"report_to": ["none"]})
    assert "report_to is none" in training_metrics_markdown(none) and tensorboard_line(none) == ""
    wandb = step.model_copy(update={"report_to": ["wandb"]})
    assert "wandb: look for the run `g-1`" in training_metrics_markdown(wandb)
    assert "tensorboard --logdir" not in training_metrics_markdown(wandb)
