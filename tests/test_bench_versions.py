"""``benchmarks/activations/bench_versions.py`` on the CPU: the smoke run with this checkout
as both the old and the new tree (tiny sizes, one round, a few configurations), whose
JSON follows the script's docstring: one worker process per tree, each configuration's
ratio over the no-offloading steps of its own process, the summary's new/old, and the
``bench_hooks.py`` rows of both trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.activations import bench_versions as bench

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["none", "k1", "fp8-k2", "checkpoint"]


@pytest.mark.slow
def test_smoke_run_with_this_checkout_as_both_trees(tmp_path) -> None:
    out = tmp_path / "v.json"
    argv = ["--quick", "--device", "cpu", "--old", str(ROOT), "--new", str(ROOT), "--out", str(out)]
    argv += ["--presets", "ref-8L", "--configs", ",".join(CONFIGS), "--rounds", "1"]
    bench.main([*argv, "--steps", "1", "--blocks", "2", "--warmup", "1", "--hooks-rounds", "1"])
    result = json.loads(out.read_text())
    assert result["reference_model_identical"]
    assert [(r["tree"], r["preset"]) for r in result["runs"]] == [
        ("old", "ref-8L"),
        ("new", "ref-8L"),
    ]
    for run in result["runs"]:
        assert "error" not in run, run["error"]
        assert Path(run["offload_file"]).parent == ROOT / "offload"
        assert [c["config"] for c in run["configs"]] == CONFIGS
        for c in run["configs"]:
            assert c["ratio"] == c["config_ms_median"] / c["none_ms_median"]
            assert c["peak_bytes"] is None and c["none_peak_bytes"] is None  # no device peak
            steps = 1 if c["config"] == "none" else 2  # blocks x steps
            assert len(c["none_ms"]) == len(c["config_ms"]) == steps
            if c["config"] in ("k1", "fp8-k2"):
                assert c["bytes_offloaded"] > 0
                assert c["layers_offloaded"] == int(c["config"][-1])
    rows = {r["config"]: r for r in result["summary"]["configs"]}
    assert list(rows) == CONFIGS
    assert rows["none"]["old_ratio"] == rows["none"]["new_ratio"] == 1.0
    for r in rows.values():
        assert r["new_over_old"] == r["new_ratio"] / r["old_ratio"]
        assert r["verdict"] in ("ok", "slower", "faster")
        assert r["peaks_equal"] is None
    assert [r["tree"] for r in result["hooks_runs"]] == ["old", "new"]
    assert all("error" not in r for r in result["hooks_runs"])
    hooks = {h["row"]: h for h in result["summary"]["hooks"]}
    for key in ("cpu direct offloaded: total", "cpu model offload all: us/saved vs identity"):
        assert hooks[key]["new_over_old"] == hooks[key]["new_us"] / hooks[key]["old_us"]


def test_configuration_names() -> None:
    assert bench.parse_config("none") == ("none", None, None)
    assert bench.parse_config("checkpoint") == ("checkpoint", None, None)
    assert bench.parse_config("auto") == ("offload", "auto", None)
    assert bench.parse_config("k7") == ("offload", 7, None)
    assert bench.parse_config("fp8-k4") == ("offload", 4, "fp8")
    for bad in ("k", "fp8", "fp8-auto", "k-1"):
        with pytest.raises(ValueError, match="configuration"):
            bench.parse_config(bad)


def test_a_worker_refuses_a_package_from_another_tree(tmp_path) -> None:
    sizes = json.dumps({"layers": 1, "hidden": 8, "heads": 1, "ffn": 8, "seq": 2, "batch": 1})
    argv = ["--worker", "--tree", str(tmp_path), "--device", "cpu", "--sizes", sizes]
    with pytest.raises(SystemExit, match="not from"):
        bench.run_worker(bench.parse_args([*argv, "--configs", "none"]))


def test_arguments_are_checked(tmp_path) -> None:
    base = ["--old", str(ROOT), "--new", str(ROOT), "--out", str(tmp_path / "x.json")]
    for bad in (
        ["--quick", "--device", "cpu", "--presets", "nope"],
        ["--quick", "--device", "cpu", "--configs", "k47"],  # not a quick configuration
        ["--quick", "--device", "cpu", "--rounds", "0"],
        ["--device", "cpu"],  # only with --quick
    ):
        with pytest.raises(SystemExit):
            bench.parse_args([*base, *bad])
    with pytest.raises(SystemExit):
        bench.parse_args(["--old", str(tmp_path), "--new", str(ROOT), "--out", "x", "--quick"])
