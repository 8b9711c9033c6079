"""``benchmarks/activations/bench_hooks_versions.py`` on the CPU: this checkout as both the
old tree (copied as ``offload_old`` with its imports renamed) and the new one, in one
process; the JSON holds every row's steps and the paired per-tensor difference."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.activations import bench_hooks_versions as bench

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


def test_smoke_run_with_this_checkout_as_both_trees(tmp_path) -> None:
    out = tmp_path / "hv.json"
    argv = ["--old", str(ROOT), "--device", "cpu", "--layers", "4", "--ops", "4"]
    argv += ["--rounds", "3", "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = ROOT / "benchmarks" / "activations" / "bench_hooks_versions.py"
    done = subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["saved_per_step"] == 16
    assert set(data["rows"]) == {"none", "old", "new"}
    assert all(len(r["step_ms"]) == 3 for r in data["rows"].values())
    assert data["rows"]["none"]["us_per_saved"] is None
    assert isinstance(data["paired_us_per_tensor"], float)
    assert "new/old us per saved tensor" in done.stdout
