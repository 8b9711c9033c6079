"""``benchmarks/diagnostics/layer_marks.py`` on the CPU with a 4-layer model: every mark
of every configuration, the offloader's host times, and its methods unwrapped after."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks.diagnostics import layer_marks  # noqa: E402
from offload.activations import _saves  # noqa: E402


def test_tiny_run_on_the_cpu(tmp_path) -> None:
    pack = _saves.Saves.__dict__["pack"]
    out = tmp_path / "marks.json"
    layer_marks.main(["--tiny", "--device", "cpu", "--lengths", "16", "--blocks", "2",
                      "--out", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    expected = {f"{k}{i}" for k in "fe" for i in range(4)} | {"fwd_end", "end"}
    for name in layer_marks.CONFIGS:
        marks = row["marks"][name]
        assert set(marks) == expected
        assert 0 < marks["f0"][0] < marks["e3"][0] < marks["end"][0]
    calls = row["calls_per_step"]
    assert calls["Step.open_group"][0] == pytest.approx(4.0)  # each layer call, each step
    assert calls["ActivationOffloader.__enter__"][0] == pytest.approx(1.0)
    assert _saves.Saves.__dict__["pack"] is pack  # the timers are gone


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        layer_marks.parse_args(["--lengths", "4k"])
    with pytest.raises(SystemExit):
        layer_marks.parse_args(["--blocks", "0"])
