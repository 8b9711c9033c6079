"""``benchmarks/activations/bench_versions_inproc.py`` on the CPU: this checkout as both the
old tree (copied as ``offload_old`` with its imports renamed) and the new one, in one
process; the JSON holds every row's steps, the ratios and the paired new/old."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.activations import bench_versions_inproc as bench

ROOT = Path(__file__).resolve().parent.parent


def test_renamed_copy_imports_nothing_of_the_original(tmp_path) -> None:
    folder = bench.renamed_copy(ROOT, tmp_path)
    left = []
    for path in (folder / "offload_old").rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.match(r"\s*(from offload[. ]|import offload\b(?!_old))", line):
                left.append((path.name, line))
    assert not left, left
    assert (folder / "offload_old" / "__init__.py").is_file()


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
def test_smoke_run_with_this_checkout_as_both_trees(tmp_path) -> None:
    out = tmp_path / "v.json"
    argv = ["--old", str(ROOT), "--device", "cpu", "--quick", "--rounds", "3", "--warmup", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = ROOT / "benchmarks" / "activations" / "bench_versions_inproc.py"
    done = subprocess.run(
        [sys.executable, str(script), *argv, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data["models"]) == {"hooks", "tiny48", "ref8l"}
    hooks = data["models"]["hooks"]["configs"]["all"]
    assert set(hooks["old"]) == {"step_ms", "step_ms_median", "ratio", "us_per_saved"}
    tiny = data["models"]["tiny48"]["configs"]
    assert set(tiny) == {"k0", "k5"}
    assert set(data["models"]["ref8l"]["configs"]) == {"auto", "k1", "k2", "k3", "k4", "checkpoint"}
    for model in data["models"].values():
        assert len(model["none_ms"]) == 3
        for row in model["configs"].values():
            assert len(row["old"]["step_ms"]) == len(row["new"]["step_ms"]) == 3
            assert row["new_over_old"] > 0 and row["paired"] > 0
    assert "us per saved tensor" in done.stdout
