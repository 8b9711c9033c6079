"""profile_step, MemoryProfile (report, JSON, plot) and ``python -m offload profile`` on
the CPU. The GPU checks (allocator peaks, stalls, link bandwidth) are in
``tests/profiling/test_profile_cuda.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import offload
from offload import MemoryProfile, cli
from offload.activations._control import Internals
from offload.profiling import LayerStats, OffloadStats
from offload.profiling._data import _example_dict
from offload.profiling._render import largest_reason, ms_text, short_bytes

ROOT = Path(__file__).resolve().parents[2]
B, D, F, L = 64, 32, 512, 3  # batch, width, hidden width of the MLP, layers


class Mlp(nn.Module):
    """``down(relu(up(x)))`` without biases: saves its input ``x`` (for ``up``'s weight
    gradient) and ``h = relu(up(x))`` (by relu, and by ``down``: the same tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, F, bias=False)
        self.down = nn.Linear(F, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _setup(**kw):
    torch.manual_seed(0)
    layers = nn.ModuleList(Mlp() for _ in range(L))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0, **kw)
    x = torch.randn(B, D)
    seen = []

    def step():
        with off:
            seen.append(bool(layers[0]._forward_pre_hooks))  # the offloader's hooks
            y = x
            for layer in layers:
                y = layer(y)
        y.square().mean().backward()

    return layers, off, step, seen


@pytest.fixture(scope="module")
def profiled():
    layers, off, step, seen = _setup()
    profile = offload.profile_step(step, off, steps=2, warmup=1)
    yield profile, off, seen
    off.close()


def test_saved_bytes_equal_the_hand_count(profiled) -> None:
    profile, _, _ = profiled
    # Offloaded: layers 0 and 1 (all but the last). Released when the next layer starts:
    # h0 and h1 (B x F fp32 each) and layer 1's input, the output of layer 0 (B x D);
    # layer 0's input x is held by the caller, so it travels but frees nothing.
    assert profile.memory_source == "offloader_stats"
    assert profile.bytes_saved == 2 * B * F * 4 + B * D * 4
    # Saved for backward without offloading: each layer's input and h, and the loss's
    # input (square saves it); weights excluded, h counted once.
    assert profile.activation_bytes_without == L * (B * D * 4 + B * F * 4) + B * D * 4
    assert profile.activation_bytes_with == (profile.activation_bytes_without - profile.bytes_saved)
    assert profile.peak_allocated_without is None and profile.link_d2h_gbps is None
    assert "of the 416.0 KiB (63%)" in profile.verdict()


def test_baseline_runs_without_hooks_and_state_is_restored(profiled) -> None:
    profile, off, seen = profiled
    n = profile.steps + profile.warmup
    # without (n), the CPU count step (1), with (n), timeline (1)
    assert seen == [False] * (n + 1) + [True] * (n + 1)
    assert type(off) is offload.ActivationOffloader
    inner = Internals(off)
    assert off.config.timing is False and inner.runtime.config.timing is False
    assert inner.is_disabled is False


def test_profile_fields(profiled) -> None:
    profile, _, _ = profiled
    assert len(profile.step_ms_with_all) == profile.steps == 2
    assert profile.time_ratio == profile.step_ms_with / profile.step_ms_without
    assert [la.offloaded for la in profile.stats.layers] == [True, True, False]
    assert all(la.d2h_seconds is not None for la in profile.stats.layers)  # timing=True
    assert profile.copies_hidden is None  # synchronous copies on the CPU
    verdict = profile.verdict()  # no accelerator: no saving claimed
    assert "the schedule ran synchronously" in verdict and "no device memory to save" in verdict
    assert not verdict.startswith("saved") and " for " not in verdict
    assert profile.host_pool_reserved_bytes > 0 and profile.rss_bytes_with > 0
    tl = profile.timeline
    assert tl.clock == "perf_counter" and not tl.copies_placed and tl.memory == []
    assert [s.index for s in tl.layers] == list(range(L))
    for a, b in zip(tl.layers, tl.layers[1:]):
        assert a.forward_end_ms <= b.forward_start_ms  # forwards in order
        assert b.backward_start_ms <= a.backward_start_ms  # backwards in reverse
    assert tl.layers[-1].forward_end_ms <= tl.layers[-1].backward_start_ms <= tl.step_ms
    kinds = {(c.layer, c.kind) for c in tl.copies}
    assert kinds == {(0, "d2h"), (1, "d2h"), (0, "h2d"), (1, "h2d")}


def test_json_round_trip(profiled) -> None:
    profile, _, _ = profiled
    data = json.loads(json.dumps(profile.to_dict()))
    again = MemoryProfile.from_dict(data)
    assert again == profile
    assert isinstance(again.stats.layers[0], LayerStats)
    assert MemoryProfile.from_dict(json.loads(json.dumps(_example_dict()))).to_dict() == (
        _example_dict()
    )


def _big_profile() -> MemoryProfile:
    """The example profile with wide numbers: 128 layers of ~1 GiB, long times."""
    p = MemoryProfile.from_dict(_example_dict())
    layers = []
    for i in range(128):
        la = LayerStats(i, i % 2 == 0, 1023 * 2**20 + 999, bytes_released=1023 * 2**20)
        la.bytes_kept["not_selected"] = 1000 * 2**20
        la.d2h_seconds, la.h2d_seconds, la.stall_seconds = 1.23456, 12.3456, 123.456
        layers.append(la)
    p.stats = OffloadStats(
        bytes_offloaded=sum(la.bytes_offloaded for la in layers),
        bytes_released=sum(la.bytes_released for la in layers),
        layers=layers,
    )
    p.stats.bytes_kept["not_selected"] = 128 * 1000 * 2**20
    p.bytes_saved, p.activation_bytes_without = 600 * 2**30, 900 * 2**30
    return p


@pytest.mark.parametrize("which", ["measured", "wide"])
def test_report_fits_80_columns(profiled, which) -> None:
    profile = profiled[0] if which == "measured" else _big_profile()
    console = Console(width=80, record=True)
    profile.report(console)
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text and "..." not in text
    assert profile.verdict() in " ".join(line.strip() for line in lines)
    # every number of every layer row is there, in full
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == len(profile.stats.layers)
    for row, la in zip(rows, profile.stats.layers):
        assert row[0] == str(la.index)
        assert row[2] == short_bytes(la.bytes_offloaded)
        # no "freed" column without an accelerator (nothing freed on a device)
        assert row[4 if profile.stats.synchronous else 5] == largest_reason(la.bytes_kept)
        assert row[-3:] == [
            ms_text(la.d2h_seconds),
            ms_text(la.h2d_seconds),
            ms_text(la.stall_seconds),
        ]


def test_stats_report_fits_80_columns(profiled) -> None:
    for stats in (profiled[0].stats, _big_profile().stats):
        console = Console(width=80, record=True)
        stats.report(console)
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= 80
        assert "…" not in text
        assert "sent to host" in text and "D2H ms" in text


def test_plot_needs_matplotlib(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    profile = MemoryProfile.from_dict(_example_dict())
    with pytest.raises(ImportError, match=r'pip install "offload\[plot\]"'):
        profile.plot(tmp_path / "t.png")


def test_plot_writes_png(profiled, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    for name, data in (("cpu", profiled[0].to_dict()), ("cuda", _example_dict())):
        path = tmp_path / f"{name}.png"
        MemoryProfile.from_dict(json.loads(json.dumps(data))).plot(path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors() -> None:
    layers, off, step, _ = _setup()
    with pytest.raises(ValueError, match="steps=0"):
        offload.profile_step(step, off, steps=0)
    with pytest.raises(TypeError, match="ActivationOffloader"):
        offload.profile_step(step, object())
    with pytest.raises(RuntimeError, match="never entered"):
        offload.profile_step(lambda: None, off, steps=1, warmup=0)
    assert type(off) is offload.ActivationOffloader and off.config.timing is False
    off.close()


def test_a_step_without_backward_is_refused() -> None:
    """A step function that runs only the forward would be reported as "forward +
    backward": refused, naming backward; the offloader is left as it was."""
    torch.manual_seed(0)
    layers = nn.ModuleList(Mlp() for _ in range(L))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    x = torch.randn(B, D)

    def forward_only():
        with off:
            y = x
            for layer in layers:
                y = layer(y)
        return y.square().mean()  # never backward

    with pytest.raises(RuntimeError, match="no backward"):
        offload.profile_step(forward_only, off, steps=1, warmup=0)
    assert off.config.timing is False and Internals(off).runtime.config.timing is False
    off.close()


def test_timing_ends_with_the_profile(profiled) -> None:
    """The step prepared for the next forward after the profile is made with the
    offloader's own config: timing stops with the profile."""
    _, off, _ = profiled
    layers = Internals(off).layers
    with off:
        y = torch.randn(B, D)
        for layer in layers:
            y = layer(y)
    y.square().mean().backward()
    assert off.stats.bytes_offloaded > 0
    assert all(la.d2h_seconds is None for la in off.stats.layers)


def test_cli_subprocess(tmp_path) -> None:
    out = tmp_path / "p.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "offload", "profile", "--layers", "2", "--hidden", "128",
           "--seq", "64", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["bytes_saved"] > 0 and data["stats"]["bytes_offloaded"] > 0
    assert "saved" in done.stdout
    assert MemoryProfile.from_dict(data).bytes_saved == data["bytes_saved"]


def test_cli_hf_config(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 128,
        "max_position_embeddings": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "p.json"
    argv = ["profile", "--hf-config", str(tmp_path / "config.json"), "--device", "cpu",
            "--seq", "32", "--steps", "1", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert len(data["stats"]["layers"]) == 2 and data["bytes_saved"] > 0
    assert "LlamaForCausalLM" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--offload-layers", "x"], "--offload-layers"),
        (["--offload-layers", "0,7"], "--offload-layers"),
        (["--heads", "3"], "--heads"),
        (["--steps", "0"], "--steps"),
        (["--device", "tpu"], "--device"),
        (["--hf-config", "/nonexistent/config.json"], "--hf-config"),
        (["--hf-config", "/nonexistent", "--hidden", "64"], "--hidden"),
    ],
)
def test_cli_bad_flags(argv, needle, capsys) -> None:
    assert cli.main(["profile", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and ("accepted" in err or "must" in err or "no such" in err), err


def test_cli_bad_choice(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["profile", "--dtype", "int8"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "bfloat16" in err
