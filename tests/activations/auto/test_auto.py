"""offload_layers="auto": the decision from layer costs, the measuring forward, re-plans
when shapes change, gradients unchanged (CPU path, with injected timings)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import offload
from offload.activations._auto._predict import LayerCost, choose, predict_step
from offload.activations._control import Internals
from tests import models
from tests.auto_fake import FakeMeter, one_thread  # noqa: F401  (fixture)
from tests.models import assert_same, step, twin

pytestmark = pytest.mark.usefixtures("one_thread")


GB = 1e9
W = 50 * GB  # bytes per second each way


def costs(fwd_ms: float, nbytes: float, n: int = 8) -> list[LayerCost]:
    return [LayerCost(fwd_ms / 1e3, 2 * fwd_ms / 1e3, int(nbytes)) for _ in range(n)]


def test_prediction_without_offloading_is_the_compute() -> None:
    c = costs(3.0, 700e6)
    assert predict_step(c, [], W, W) == pytest.approx(8 * 9.0 / 1e3)


def test_compute_bound_layers_offload_all_but_the_last() -> None:
    # 1 MB per layer against 10 ms of forward: copies are free
    d = choose(costs(10.0, 1e6), W, W, 0.03)
    assert d.offloaded == list(range(7))
    assert d.predicted_ratio <= 1.03


def test_link_bound_layers_offload_only_what_hides() -> None:
    # ref-8L-like: 3.3 ms forward, 6.6 ms backward, 740 MB (14.8 ms each way)
    d = choose(costs(3.3, 740e6), 55 * GB, 55 * GB, 0.03)
    assert 1 <= len(d.offloaded) <= 3
    assert d.offloaded == list(range(len(d.offloaded)))
    assert d.predicted_ratio <= 1.03 < d.next_ratio
    assert "more would exceed" in d.reason


def test_hopeless_link_offloads_nothing() -> None:
    d = choose(costs(0.1, 5e9), W, W, 0.03)
    assert d.offloaded == []


def test_mixed_costs_stop_at_the_first_layer_that_does_not_hide() -> None:
    c = costs(10.0, 1e6, n=4) + costs(0.5, 2e9, n=4)
    d = choose(c, W, W, 0.03)
    assert d.offloaded == list(range(len(d.offloaded)))
    assert 2 <= len(d.offloaded) <= 4
    assert predict_step(c, d.offloaded, W, W) <= 1.03 * d.base_seconds


def test_larger_budget_offloads_more() -> None:
    c = costs(3.3, 740e6)
    small = choose(c, 55 * GB, 55 * GB, 0.03)
    large = choose(c, 55 * GB, 55 * GB, 1.0)
    assert len(large.offloaded) > len(small.offloaded)


def test_cpu_path_auto_selects_like_all() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)  # "auto" default
    assert off.config.offload_layers == "auto"
    x = torch.randn(2, 16, 64)
    assert_same(step(layers, x, models.run_plain, off), step(ref, x, models.run_plain))
    stats = off.stats
    assert [la.offloaded for la in stats.layers] == [True, True, True, False]
    assert "no accelerator" in stats.auto["reason"]


def _fake(per_size, link_s_per_layer: float, gap=lambda n: 0.0) -> FakeMeter:
    """A meter whose layers cost ``per_size(tokens, n_layers)`` and whose link takes
    about ``link_s_per_layer`` for one layer's real bytes at 32 tokens."""
    bps = _layer_bytes(32) / link_s_per_layer
    return FakeMeter(lambda n: per_size(n, 4), bps, gap=gap)


def _layer_bytes(tokens: int) -> float:
    """What one LlamaBlock(64) layer of these tests sends at ``tokens`` (batch 2)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(2))
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=1024)
    step(layers, torch.randn(2, tokens // 2, 64), models.run_plain, off)
    off.close()
    return float(off.stats.layers[0].bytes_offloaded)


@pytest.mark.parametrize(
    ("fwd_ms", "link_ms"),
    [(10.0, 0.02), (0.01, 100.0), (3.3, 2.0)],
)
def test_auto_measures_then_offloads_and_stays_bitwise_equal(fwd_ms, link_ms) -> None:
    meter = _fake(lambda n, L: costs(fwd_ms, 0, L), link_ms / 1e3)
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    Internals(off).use_meter(meter)
    x = torch.randn(2, 16, 64)
    expected = None
    for it in range(4):
        got = step(layers, x + it, models.run_plain, off)
        assert_same(got, step(ref, x + it, models.run_plain))
        auto = off.stats.auto
        chosen = [la.index for la in off.stats.layers if la.offloaded]
        if it == 0:  # the measuring forward offloads like "all"
            assert chosen == [0, 1, 2] and "measuring" in auto["reason"]
            assert off.stats.bytes_offloaded > 0
            continue
        # the choice the true costs give, with the bytes the measuring forward saw
        true = [
            dataclasses.replace(c, nbytes=b["nbytes"], copies=b["copies"])
            for c, b in zip(costs(fwd_ms, 0, 4), auto["costs"])
        ]
        expected = choose(true, meter.bps, meter.bps, 0.03).offloaded
        assert auto["chosen"] == expected, (it, auto)
        assert chosen == auto["offloaded"]
        # [] only in a verifying step without offloading; the step that measures again
        # after the cold first step offloads one layer (offload/activations/_auto/_policy.py)
        cold_probe = auto["step"] == "probe" and auto["cold"]
        assert chosen in (expected, []) or (cold_probe and chosen == expected[:1]), auto
        assert (chosen == []) == (auto["step"] == "none" or not expected)
        assert (off.stats.bytes_offloaded > 0) == bool(chosen)
    assert expected is not None


def test_auto_replans_when_the_size_changes() -> None:
    # attention-bound layers: compute grows with tokens * length, bytes with tokens, so
    # short sequences are link-bound (nothing hides) and long ones compute-bound
    def per_size(n, L):
        q = n * (n // 2)
        return [LayerCost(4e-7 * q, 8e-7 * q, 0) for _ in range(L)]

    meter = _fake(per_size, 1e-3)
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    Internals(off).use_meter(meter)
    seen = {}
    for seq in (16, 16, 128, 128, 128, 16, 16, 16, 128, 16):
        x = torch.randn(2, seq, 64)
        assert_same(step(layers, x, models.run_plain, off), step(ref, x, models.run_plain))
        seen[seq] = off.stats.auto["chosen"] if "chosen" in off.stats.auto else None
    assert seen[16] == [] and seen[128] == [0, 1, 2], seen
    families = off.last_step.auto_state.families
    assert len(families) == 1  # one kind of input, two sizes
    assert set(families[0].measured_tokens) == {32, 256}


def test_launch_bound_layers_count_the_hosts_extra_work() -> None:
    # tiny48-like: the host takes longer than the device to issue each layer, and
    # offloading would add its per-copy host work on top: nothing hides
    c = [LayerCost(0.5e-3, 1.0e-3, 10 << 20, 0.9e-3, 1.2e-3, 9) for _ in range(48)]
    d = choose(c, 50 * GB, 50 * GB, 0.03)
    assert len(d.offloaded) <= 1
    # the same bytes in one copy per layer, issued by a fast host: the link alone
    # decides, and it hides them all
    fast = [LayerCost(0.5e-3, 1.0e-3, 10 << 20, 0.05e-3, 0.05e-3, 1) for _ in range(48)]
    assert len(choose(fast, 50 * GB, 50 * GB, 0.03).offloaded) == 47
