"""``benchmarks/longctx/render.py``: the long-context tables of README.md and
docs/long-context.md are the ones its results files give (and it renders rows of every
status)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def render():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.longctx import render

        yield render
    finally:
        sys.path.remove(str(ROOT))


def test_pages_match_the_results_files(render) -> None:
    if not (render.RESULTS / "long_context.json").is_file():
        pytest.skip("benchmarks/results/long_context.json not measured yet")
    assert render.main(["--check"]) == 0, "run python3 benchmarks/longctx/render.py"


def test_tables_name_the_card_and_every_outcome(render) -> None:
    def row(method, seq, status="ok", **extra):
        base = {"model": "llama-8b-lora", "method": method, "seq": seq, "status": status}
        if status == "ok":
            base |= {"step_ms": 1000.0, "tokens_per_s": seq / 1.0, "activation_peak_gib": 3.0,
                     "host_peak_gib": 9.0}  # fmt: skip
        return base | extra

    doc = {
        "environment": {"gpu": "NVIDIA H100 80GB HBM3"},
        "rows": [row("hf-ckpt", 16384), row("hf-ckpt", 32768, "oom", reason="x"),
                 row("ours-ckpt-head", 16384), row("ours-ckpt-head", 32768),
                 row("ours-ckpt-head", 131072, "killed", reason="signal 9"),
                 row("ours-ckpt-head", 65536),
                 row("trl-offload", 16384, "skipped", reason="trl is not installed"),
                 row("trl-offload", 32768, "skipped", reason="trl is not installed")],
    }  # fmt: skip
    head = render.headline(doc)
    assert "one NVIDIA H100 80GB HBM3" in head
    assert "| HF checkpointing | 16384 | 3.0 | OOM | OOM | - | - | - | - | 16,384 |" in head
    ours = (
        "| **`offload_checkpointing` + `sliced_head_loss`** | 16384 | 3.0 | 32768 | 3.0 "
        "| 65536 | 3.0 | host OOM | host OOM | 65,536 |"
    )
    assert ours in head  # stopped by the host at 131,072 (no "+": a longer one failed)
    assert "TRL" not in head  # skipped everywhere: not a row
    assert "(a)" not in head  # every row from the file's own command
    body = render.full(doc)
    assert "Not run: trl-offload (trl is not installed)." in body
    assert "| 65,536 | 65536 | host memory (killed) at 131,072 |" in body
    assert "| 16,384 | 16384 | device OOM at 32,768 |" in body
    assert "| llama-8b-lora | 32768 | HF checkpointing | OOM |" in body


def _doc(*rows: dict, **extra) -> dict:
    """A results file of ``gpu_suite.sh longctx`` on an H100 holding ``rows``."""
    return {"command": ["benchmarks/gpu_suite.sh", "longctx"],
            "environment": {"gpu": "NVIDIA H100 80GB HBM3"}, "rows": list(rows), **extra}  # fmt: skip


def _row(method: str, tokens_per_s: float, measured_with: str) -> dict:
    """A Llama ~1.1B row at 16k tokens that trained, measured with ``measured_with``."""
    return {"model": "llama-1b", "method": method, "seq": 16384, "tokens_per_s": tokens_per_s,
            "measured_with": measured_with, "status": "ok", "step_ms": 1000.0,
            "activation_peak_gib": 3.0, "host_peak_gib": 9.0}  # fmt: skip


def test_rows_of_another_call_are_marked(render) -> None:
    doc = _doc(
        _row("none", 16384.0, "benchmarks/gpu_suite.sh longctx"),
        _row("unsloth-zoo", 8192.0, "bench_long_context.py --models llama-1b"),
    )
    head = render.headline(doc)
    assert "| no offloading | 16384 | 3.0 | 16,384+ |" in head
    assert "| 8192 (a) | 3.0 | 16,384+ |" in head
    assert "(a) measured in a separate call" in head and "(b)" not in head
    assert "| unsloth_zoo offloaded checkpointing + fused loss (a) |" in render.full(doc)


def test_each_other_call_has_its_mark_and_note(render) -> None:
    """Rows of ``same_machine`` commands are unmarked; each other call's rows get their own
    letter, with the file's note for it where it has one."""
    same = "bench_long_context.py --models llama-1b --steps 4"
    doc = _doc(
        _row("none", 16384.0, same),
        _row("hf-ckpt", 9000.0, "call one"),
        _row("unsloth-zoo", 8192.0, "call two"),
        same_machine=[same],
        apart_notes={"call two": "measured with an older tree."},
    )
    body = render.full(doc)
    assert "| llama-1b | 16384 | no offloading | 1000 |" in body
    assert "| HF checkpointing (a) |" in body
    assert "| unsloth_zoo offloaded checkpointing + fused loss (b) |" in body
    assert "(a) measured in a separate call" in body
    assert "(b) measured with an older tree." in body
