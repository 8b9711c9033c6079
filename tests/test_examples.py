"""Smoke tests: every script in ``examples/`` runs on CPU with small arguments.

Each example runs in a subprocess (``sys.executable``, the repository root on
``PYTHONPATH``, accelerators hidden with ``CUDA_VISIBLE_DEVICES=""`` so the run is the
same on every machine) and must exit with status 0 and print what its docstring
promises. Examples written elsewhere (``quickstart.py``, ``moe.py``) are run with small
arguments when present and skipped when not.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 180  # seconds per run; each takes a few seconds on 2 CPU cores


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU path everywhere: quick and deterministic
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)  # never join a group of the process running pytest
    env.pop("WORLD_SIZE", None)
    return env


def _run(args: list[str], timeout: float = TIMEOUT) -> str:
    """Run ``python *args`` from the repository root; returns stdout, fails on rc != 0."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def _example(name: str) -> Path:
    path = EXAMPLES / name
    if not path.is_file():
        pytest.skip(f"examples/{name} does not exist")
    return path


def _losses(out: str, pattern: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, out)]


# ---- examples/hf_llama.py ------------------------------------------------------------


def test_hf_llama(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path = _example("hf_llama.py")
    out_json = tmp_path / "llama.json"
    out = _run([str(path), "--steps", "2", "--device", "cpu", "--out", str(out_json)])
    base = _losses(out, r"\[baseline\] step \d+: loss ([\d.]+)")
    off = _losses(out, r"\[offload\] step \d+: loss ([\d.]+)")
    assert len(base) == len(off) == 2
    assert base == off  # fp32 on CPU: the same losses to the printed digit
    assert "bytes offloaded per step:" in out
    assert "max |loss difference| between the runs: 0" in out
    record = json.loads(out_json.read_text())
    assert record["summary"]["bytes_offloaded"] > 0
    assert record["summary"]["max_loss_difference"] == 0
    layers = record["runs"]["offload"]["stats"]["layers"]
    assert [la["bytes_offloaded"] > 0 for la in layers] == [True] * (len(layers) - 1) + [False]


def test_hf_llama_rejects_bad_arguments() -> None:
    path = _example("hf_llama.py")
    proc = subprocess.run(
        [sys.executable, str(path), "--size", "7b"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 2
    assert "invalid choice: '7b'" in proc.stderr


# ---- examples/hf_trainer.py ----------------------------------------------------------


def test_hf_trainer() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    path = _example("hf_trainer.py")
    out = _run([str(path), "--steps", "2", "--device", "cpu"])
    assert len(_losses(out, r"step \d+: loss ([\d.]+)")) == 2
    match = re.search(r"bytes offloaded in the last step: (\d+)", out)
    assert match and int(match.group(1)) > 0, out
    assert "offload: saved tensors of the last forward" in out  # offloader.report()


# ---- examples/te_compat.py -----------------------------------------------------------


def test_te_compat() -> None:
    path = _example("te_compat.py")
    out = _run([str(path), "--steps", "2", "--device", "cpu"])
    assert "get_cpu_offload_context(True, num_layers=3, model_layers=4)" in out
    assert out.count("grads equal: True") == 3  # two steps and the verdict
    assert "grads equal: False" not in out
    match = re.search(r"offloaded in the last step: ([\d.]+) (\w+)", out)
    assert match and float(match.group(1)) > 0


# ---- examples/fsdp2.py ---------------------------------------------------------------


def _check_fsdp2(out: str, world: int) -> None:
    assert f"FSDP2 on {world} process(es), backend gloo, device cpu" in out
    assert (
        len(re.findall(r"step \d+: loss [\d.]+ \(without offloading [\d.]+, equal: True\)", out))
        == 2
    )
    assert "equal: False" not in out
    match = re.search(r"rank 0 offloaded (\d+) bytes \(.*\) in 3 of 4 layers", out)
    assert match and int(match.group(1)) > 0, out
    assert "'parameter'" in out  # FSDP's unsharded weights are recognised, not copied
    assert out.rstrip().endswith("done")


def test_fsdp2_single_process() -> None:
    path = _example("fsdp2.py")
    _check_fsdp2(_run([str(path), "--steps", "2"]), world=1)


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
@pytest.mark.distributed
def test_fsdp2_torchrun_two_processes() -> None:
    path = _example("fsdp2.py")
    out = _run(
        [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",
            str(path),
            "--steps",
            "2",
        ]
    )
    _check_fsdp2(out, world=2)


def test_weights_example() -> None:
    """examples/weights.py on the CPU: the blocks' weights offloaded with grads="host",
    a CPU AdamW on the host masters; the loss of its one batch goes down."""
    out = _run([str(_example("weights.py")), "--steps", "4"])
    losses = [float(m) for m in re.findall(r"step \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 4, out[-2000:]
    assert losses[-1] < losses[0], losses
    assert "at most 2 of 4 blocks on the device at once" in out, out[-2000:]


# ---- examples owned elsewhere --------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("moe.py", [], ["step 0: loss"]),
        (
            "compress.py",
            ["--steps", "2", "--device", "cpu"],
            ["lowest cosine similarity", "step 1: loss exact", "ratio 0.2"],
        ),
        ("planner.py", ["--device", "cpu", "--steps", "2"], ["bitwise equal: True"]),
        ("cuda_graphs.py", [], ["CUDA graphs need a CUDA device"]),
        (
            "long_context.py",
            ["--steps", "2", "--device", "cpu"],
            ["[levers] step 1: loss", "gradients within tolerance: True"],
        ),
        (
            "te_pipeline.py",
            ["--device", "cpu"],
            ["micro-batch 1: bytes sent", "gradients bitwise equal to no offloading: True"],
        ),
    ],
)
def test_other_examples_run(name: str, args: list[str], expected: list[str]) -> None:
    path = _example(name)
    out = _run([str(path), *args])
    for text in expected:
        assert text in out, f"examples/{name} did not print {text!r}:\n{out[-2000:]}"


def test_quickstart_on_a_cpu_says_what_runs_and_claims_no_saving() -> None:
    """Without an accelerator the quickstart says once that the schedule ran
    synchronously with no device memory to save, and never reports freed device
    memory."""
    out = _run([str(_example("quickstart.py")), "--steps", "2", "--device", "cpu"])
    assert "step 0: loss" in out and "step 1: loss" in out, out[-2000:]
    flat = " ".join(out.split())  # rich wraps lines
    assert flat.count("the schedule ran synchronously") == 1, out[-2000:]
    assert "there is no device memory to save" in flat, out[-2000:]
    assert "freed" not in flat and "on the device)" not in flat, out[-2000:]


# ---- all examples ----------------------------------------------------------------------


def test_every_example_has_a_docstring() -> None:
    scripts = sorted(EXAMPLES.glob("*.py"))
    if not scripts:
        pytest.skip("examples/ holds no scripts")
    missing = [p.name for p in scripts if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, (
        f"examples without a module docstring (how to run, what it prints): {missing}"
    )
