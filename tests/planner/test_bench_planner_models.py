"""``benchmarks/planner/bench_planner_models.py`` on the CPU: a smoke run with tiny sizes (the
cost model synthetic: ``offload.plan`` needs CUDA) whose JSON follows the script's
docstring: per budget, no lever, the plan and the best single lever in alternating
blocks, and the ratios computed from the pooled steps."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "planner"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_planner_models

        yield bench_planner_models
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
def test_smoke_run(bench, tmp_path) -> None:
    out = tmp_path / "p.json"
    argv = ["--quick", "--device", "cpu", "--out", str(out), "--cases", "ref-8L"]
    bench.main([*argv, "--steps", "2", "--warmup", "1", "--ab-rounds", "2"])
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    assert case["case"]["name"] == "ref-8L"
    singles = case["singles"]
    assert {"keep", "selective", "checkpoint", "checkpoint_offload"} <= set(singles)
    rows = [r for r in case["budgets"] if "plan" in r]
    assert rows, case["budgets"]
    for row in rows:
        ab = row["ab"]
        for name in ab:
            assert len(ab[name]["times_ms"]) == 2 * 2  # rounds x steps
            assert ab[name]["ms"] == statistics.median(ab[name]["times_ms"])
        assert row["ratio_to_none"] == ab["plan"]["ms"] / ab["none"]["ms"]
        best = row["best_single"]
        # no device peak on the CPU: every single lever fits, the fastest measured wins
        assert best == min(
            (n for n in singles if "levers" in singles[n]), key=lambda n: singles[n]["ms"]
        )
        if "single" in ab:
            assert row["ratio_to_single"] == ab["plan"]["ms"] / ab["single"]["ms"]
        assert row["verdict"] in ("pass", "FAIL", "n/a")


def test_arguments_are_checked(bench) -> None:
    for bad in (["--cases", "nope"], ["--steps", "0"], ["--device", "cpu"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x", *bad] + (["--quick"] if bad[0] != "--device" else []))
