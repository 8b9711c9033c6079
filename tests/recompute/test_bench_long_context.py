"""``benchmarks/longctx/bench_long_context.py`` on the CPU: the smoke run spawns one
process per configuration and writes their rows; missing peers are skipped with a
reason; ``--longest`` doubles the length and says what stopped it; the tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))  # benchmarks.* imports as a package from the root
    try:
        from benchmarks.longctx import bench_long_context

        yield bench_long_context
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
def test_quick_run_one_process_per_configuration(bench, tmp_path, capsys) -> None:
    out = tmp_path / "lc.json"
    methods = "none,ours-ckpt-head-tile,trl-offload,hf-ckpt-offload"
    args = ["--quick", "--device", "cpu", "--models", "llama-1b", "--methods", methods]
    assert bench.main([*args, "--warmup", "1", "--steps", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "long_context"
    rows = {r["method"]: r for r in doc["rows"]}
    assert list(rows) == methods.split(",")
    for method in ("none", "ours-ckpt-head-tile"):
        row = rows[method]
        assert row["status"] == "ok", row
        assert row["seq"] == 64 and row["step_ms"] > 0 and len(row["step_ms_all"]) == 2
        assert row["tokens_per_s"] == pytest.approx(64 / (row["step_ms"] / 1e3))
        assert row["host_peak_gib"] > 0 and row["activation_peak_gib"] is None  # no CUDA
    # the same model and batch: the levers give the plain loss
    assert rows["ours-ckpt-head-tile"]["loss"] == pytest.approx(rows["none"]["loss"], rel=1e-5)
    assert rows["hf-ckpt-offload"]["status"] == "skipped"
    if rows["trl-offload"]["status"] == "skipped":
        assert "trl is not installed" in rows["trl-offload"]["reason"]
    printed = capsys.readouterr().out
    assert "| llama-1b | ours-ckpt-head-tile | 64 |" in printed


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
def test_longest_doubles_until_max_seq(bench, tmp_path) -> None:
    out = tmp_path / "longest.json"
    args = ["--quick", "--device", "cpu", "--models", "llama-1b", "--methods", "ours-ckpt-head"]
    assert bench.main([*args, "--longest", "--max-seq", "128", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert [t["seq"] for t in row["tried"]] == [64, 128]
    assert row["longest_seq"] == 128 and row["stopped_by"] == "max-seq"


def test_longest_reports_what_stopped_it(bench, monkeypatch) -> None:
    def fake_spawn(args, model, method, seq, warmup, steps):
        assert (warmup, steps) == (0, 3)
        if seq > 32768:
            return {"model": model, "method": method, "seq": seq, "status": "oom", "reason": "x"}
        return {"model": model, "method": method, "seq": seq, "status": "ok",
                "step_ms": 1.0, "tokens_per_s": seq / 1e-3, "host_peak_gib": 1.0}  # fmt: skip

    monkeypatch.setattr(bench, "spawn", fake_spawn)
    args = bench.parse_args(["--longest", "--max-seq", "1048576", "--device", "cpu"])
    row = bench.longest(args, "llama-8b-lora", "ours-ckpt")
    assert [t["seq"] for t in row["tried"]] == [16384, 32768, 65536]
    assert row["longest_seq"] == 32768 and row["stopped_by"] == "oom"
    assert "| llama-8b-lora | ours-ckpt | 32768 |" in bench.longest_table([row])


def test_table_ratio_to_none_and_failures(bench) -> None:
    rows = [
        {"model": "m", "method": "none", "seq": 8, "status": "ok", "step_ms": 10.0,
         "tokens_per_s": 800.0, "activation_peak_gib": 2.0, "host_peak_gib": 1.0},
        {"model": "m", "method": "ours-ckpt", "seq": 8, "status": "ok", "step_ms": 12.5,
         "tokens_per_s": 640.0, "activation_peak_gib": 0.5, "host_peak_gib": 3.0},
        {"model": "m", "method": "trl-offload", "seq": 8, "status": "oom", "reason": "CUDA"},
    ]  # fmt: skip
    text = bench.table(rows)
    assert "| m | ours-ckpt | 8 | 12.5 | 1.25 | 640 | 0.50 | 3.0 | ok |" in text
    assert "| m | trl-offload | 8 | - | - | - | - | - | oom: CUDA |" in text


def test_bad_names_list_the_accepted_ones(bench) -> None:
    with pytest.raises(SystemExit, match="accepted: none, hf-ckpt"):
        bench.main(["--methods", "none,fast", "--device", "cpu"])
    with pytest.raises(SystemExit, match="llama-1b, llama-8b-lora"):
        bench.main(["--models", "llama-70b", "--device", "cpu"])
