"""``benchmarks/diagnostics/new_lengths.py`` on the CPU with a 4-layer model: a row per
step with what "auto" ran, the ratios and the host times, and the timers removed after."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks.diagnostics import new_lengths  # noqa: E402
from offload.activations._auto import _policy as _auto_policy  # noqa: E402


def test_tiny_run_on_the_cpu(tmp_path) -> None:
    prepare = _auto_policy.AutoPolicy.__dict__["prepare"]
    out = tmp_path / "new_lengths.json"
    new_lengths.main(["--tiny", "--device", "cpu", "--steps", "4", "--min", "16", "--max", "48",
                      "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(16 <= r["tokens"] <= 48 for r in rows)
    assert rows[0]["run"] == "probe" and rows[0]["offloaded"] == 3  # measures like "all"
    assert all(r["ratio"] > 0 and r["one_layer_ratio"] > 0 for r in rows)
    assert all(r["host_ms"]["AutoPolicy.prepare"] > 0 for r in rows)
    assert all(r["state"]["families"] == 1 for r in rows)
    assert _auto_policy.AutoPolicy.__dict__["prepare"] is prepare  # the timers are gone


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        new_lengths.parse_args(["--min", "64", "--max", "32"])
    with pytest.raises(SystemExit):
        new_lengths.parse_args(["--steps", "0"])
