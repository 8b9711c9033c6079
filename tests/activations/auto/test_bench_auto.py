"""``benchmarks/activations/bench_auto.py``'s A/B on the CPU: the ratio pairs adjacent
blocks (so a drift of the machine's speed cancels) and leaves "auto"'s own verifying
steps out; the quick run end to end."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.activations import bench_auto


class _Scripted(bench_auto.Runner):
    """Steps whose time drifts up 1 % a step; offloading costs ``cost`` over the same
    moment's step without offloading."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.t = 0

    def step(self, off=None):
        self.t += 1
        ms = 100.0 * (1.01**self.t)
        return (ms * self.cost if off is not None else ms), None


def test_the_ratio_pairs_adjacent_blocks_and_cancels_drift() -> None:
    runner = _Scripted(1.02)
    got = runner.ab(object(), rounds=9, steps=1)
    # adjacent steps differ by the 1 % drift, one way or the other in turn (ABBA)
    assert got["ratio"] == pytest.approx(1.02, rel=0.011)
    assert len(got["none_ms"]) == len(got["off_ms"]) == 9
    assert got["ratio_of_medians"] == pytest.approx(got["ratio_all"])


def test_verifying_steps_of_auto_are_left_out() -> None:
    runner = _Scripted(1.0)
    kinds = iter(["verify", "plan"] * 10)
    got = runner.ab(object(), rounds=6, steps=2, watch=lambda: next(kinds))
    assert got["auto_steps"] == ["verify", "plan"] * 6
    assert got["ratio"] is not None and got["ratio_of_medians"] is not None


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
def test_quick_run_on_the_cpu(tmp_path, monkeypatch) -> None:
    out = tmp_path / "auto.json"
    argv = ["bench_auto.py", "--quick", "--device", "cpu", "--runs", "1", "--rounds", "3",
            "--k-rounds", "2", "--models", "ref-8L", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_auto.main()
    result = json.loads(out.read_text())
    (row,) = result["results"]["ref-8L"]
    assert row["ratio"] > 0 and row["auto"]["ab"]["ratio_of_medians"] > 0
    assert result["summary"]["ref-8L"]["ratios"] == [row["ratio"]]
