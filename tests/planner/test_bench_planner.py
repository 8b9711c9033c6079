"""``benchmarks/planner/bench_planner.py`` on the CPU: the script runs end to end (a smoke run
with tiny sizes) and its A/B measurement and verdicts follow its module docstring."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))  # benchmarks.* imports as a package from the root
    try:
        from benchmarks.planner import bench_planner

        yield bench_planner
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
def test_smoke_run_measures_each_budget_against_no_lever_in_blocks(bench, tmp_path) -> None:
    out = tmp_path / "p.json"
    bench.main(
        [
            "--quick",
            "--device",
            "cpu",
            "--out",
            str(out),
            *("--steps", "5", "--warmup", "1", "--ab-rounds", "2", "--ab-steps", "2"),
            *("--ab-warmup", "1"),
        ]
    )
    result = json.loads(out.read_text())
    assert result["settings"]["ab_rounds"] == 2 and result["settings"]["ab_steps"] == 2
    for row in result["budgets"]:
        ab = row.get("ab")
        if row["fraction"] is None:  # checkpoint every layer's memory: no ratio target
            assert ab is None
            continue
        assert len(ab["none_times_ms"]) == len(ab["plan_times_ms"]) == 4
        assert ab["none_ms_median"] == statistics.median(ab["none_times_ms"])
        assert ab["ratio"] == ab["plan_ms_median"] / ab["none_ms_median"]


def test_ratio_targets_are_judged_on_the_ab_ratio(bench) -> None:
    rows = [{"name": "checkpoint 2", "step_ms_median": 10.0, "levers": ["keep"] * 2}]
    row = {
        "measured": {"step_ms_median": 11.0, "peak_bytes": 5},
        "budget_bytes": 10,
        "best_single": None,
        "target_ratio": 1.02,
        "ratio_to_none": 1.05,  # in sequence: over the target
        "ab": {"ratio": 1.01},  # against no lever in alternating blocks: within it
    }
    bench.judge(row, rows)
    assert row["checks"]["target"] is True and row["verdict"] == "pass"
    row["ab"] = {"ratio": 1.03}
    bench.judge(row, rows)
    assert row["checks"]["target"] is False and row["verdict"] == "FAIL"
    del row["ab"]  # --ab-rounds 0: the sequential ratio decides
    bench.judge(row, rows)
    assert row["checks"]["target"] is False
    row["ratio_to_none"] = 1.0
    bench.judge(row, rows)
    assert row["checks"]["target"] is True


def test_ab_arguments_are_checked(bench, capsys) -> None:
    base = ["--out", "x", "--quick", "--device", "cpu"]
    assert bench.parse_args(base).ab_warmup == 4
    for bad in (["--ab-warmup", "0"], ["--ab-steps", "0"], ["--ab-rounds", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(base + bad)
        assert "rounds >= 0, steps >= 1, warm-up >= 1" in capsys.readouterr().err
