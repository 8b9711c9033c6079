"""offload_layers="auto": the decision from layer costs, the measuring forward, re-plans
when shapes change, gradients unchanged (CPU path, with injected timings)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload import _auto
from offload._auto import LayerCost, choose, predict_step
from offload._scheduler import Step
from tests import models
from tests.models import assert_same, step, twin

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


def _inject(monkeypatch, per_shape):
    """Probe costs from a function of the forward's input length; bandwidth W."""
    monkeypatch.setattr(_auto, "link_bandwidth", lambda device, nbytes=0: (W, W))

    def probe_costs(self):
        if not all(g.marks and "b0" in g.marks for g in self.groups):
            return None
        seq = self.probe_seq
        return [(c.forward_s, c.backward_s, c.nbytes) for c in per_shape(seq, len(self.groups))]

    monkeypatch.setattr(Step, "probe_costs", probe_costs)


@pytest.mark.parametrize(
    ("fwd_ms", "nbytes", "expected"),
    [(10.0, 1e6, [0, 1, 2]), (0.01, 5e9, []), (3.3, 100e6, [0, 1, 2])],
)
def test_auto_measures_then_offloads_and_stays_bitwise_equal(
    monkeypatch, fwd_ms, nbytes, expected
) -> None:
    _inject(monkeypatch, lambda seq, n: costs(fwd_ms, nbytes, n))
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    off._auto.measure_on_cpu = True
    x = torch.randn(2, 16, 64)
    for it in range(3):
        monkeypatch.setattr(Step, "probe_seq", 16, raising=False)
        got = step(layers, x + it, models.run_plain, off)
        assert_same(got, step(ref, x + it, models.run_plain))
        chosen = [la.index for la in off.stats.layers if la.offloaded]
        if it == 0:  # the measuring forward offloads nothing
            assert chosen == [] and "measuring" in off.stats.auto["reason"]
            assert off.stats.bytes_offloaded == 0
        else:
            assert chosen == expected, (it, off.stats.auto)
            assert off.stats.auto["offloaded"] == expected
            assert (off.stats.bytes_offloaded > 0) == bool(expected)


def test_auto_replans_when_the_shape_changes(monkeypatch) -> None:
    # short sequences: link-bound (nothing hides); long ones: compute-bound
    def per_shape(seq, n):
        return costs(0.01, 5e9, n) if seq == 16 else costs(50.0, 1e6, n)

    _inject(monkeypatch, per_shape)
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    off._auto.measure_on_cpu = True
    seen = []
    for seq in (16, 16, 32, 32, 16):
        monkeypatch.setattr(Step, "probe_seq", seq, raising=False)
        x = torch.randn(2, seq, 64)
        assert_same(step(layers, x, models.run_plain, off), step(ref, x, models.run_plain))
        seen.append([la.index for la in off.stats.layers if la.offloaded])
    assert seen == [[], [], [], [0, 1, 2], []]
    assert len(off._auto.decisions) == 2


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
