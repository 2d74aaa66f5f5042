"""bench/growth_common.py: the figures every growth table is made of."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from growth_common import ratio, run_measured  # noqa: E402

GROW = "x = bytearray({mib} << 20); x[::4096] = b'x' * len(x[::4096])"


def test_a_commands_peak_is_its_own_not_the_peak_of_the_process_that_ran_it() -> None:
    # Linux carries a process's peak RSS over into what it execs: measured directly, this process's
    # 400 MiB became the child's
    big = bytearray(400 << 20)
    big[::4096] = b"x" * len(big[::4096])
    del big
    small = run_measured([sys.executable, "-c", "pass"])
    grown = run_measured([sys.executable, "-c", GROW.format(mib=200)])
    assert small.rss_mib < 100, small
    assert 200 <= grown.rss_mib < 300, grown
    assert small.seconds > 0 and grown.cpu_s > 0


def test_a_failing_command_stops_the_benchmark_with_its_error_and_output_is_captured() -> None:
    with pytest.raises(SystemExit, match="(?s)failed:\n.*ValueError: no"):
        run_measured([sys.executable, "-c", "raise ValueError('no')"])
    with pytest.raises(SystemExit, match="No such file"):
        run_measured(["/nonexistent/command"])
    assert run_measured([sys.executable, "-c", "print('hi')"], capture=True).stdout == "hi\n"


def test_a_ratio_refuses_nan_and_a_zero_baseline() -> None:
    assert ratio(3.0, 2.0) == 1.5
    for num, den in ((math.nan, 1.0), (1.0, math.nan), (1.0, 0.0)):
        with pytest.raises(ValueError):
            ratio(num, den)
