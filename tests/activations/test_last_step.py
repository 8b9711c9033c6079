"""``ActivationOffloader.last_step``: the read-only view of the most recent step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload


def _layers(n: int = 4) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(n))


def _forward(layers: torch.nn.ModuleList, off: offload.ActivationOffloader) -> torch.Tensor:
    x = torch.randn(32, 64, requires_grad=True)
    with off:
        h = x
        for layer in layers:
            h = torch.relu(layer(h))
    return h


def test_none_before_the_first_forward() -> None:
    off = offload.ActivationOffloader(_layers(), offload_layers="all")
    assert off.last_step is None
    off.close()


def test_per_layer_transitions_through_forward_and_backward() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, offload_layers=[0, 2], min_tensor_bytes=0)
    h = _forward(layers, off)
    view = off.last_step
    assert view is not None and view.forward_done and not view.backward_done
    assert [la.index for la in view.layers] == [0, 1, 2, 3]
    assert [la.planned for la in view.layers] == [True, False, True, False]
    assert [la.offloaded for la in view.layers] == [True, False, True, False]
    assert [la.released for la in view.layers] == [True, False, True, False]
    assert not any(la.reloaded or la.dropped for la in view.layers)
    assert view.capture is None and not view.manual and view.auto is None
    assert view.waits is None  # timing=False
    h.sum().backward()
    after = off.last_step
    assert after.backward_done and after.spare_buffers == 0
    assert [la.dropped for la in after.layers] == [True, False, True, False]
    stats = off.stats
    assert [la.bytes_offloaded for la in after.layers] == [s.bytes_offloaded for s in stats.layers]
    assert [la.bytes_released for la in after.layers] == [s.bytes_released for s in stats.layers]
    # a snapshot: frozen, and unchanged by a later step
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.capture = "step"  # type: ignore[misc]
    _forward(layers, off).sum().backward()
    assert view.forward_done and not view.backward_done
    off.close()


def test_timing_fills_the_waits() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0, timing=True)
    _forward(layers, off).sum().backward()
    view = off.last_step
    assert view.waits is not None and view.waits >= 0.0
    assert all(la.stall_seconds is not None for la in view.layers)
    off.close()


def test_auto_decision_is_the_stats_one() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)  # offload_layers="auto"
    _forward(layers, off).sum().backward()
    view = off.last_step
    assert view.auto is not None and view.auto == off.stats.auto
    off.close()


def test_running_forward_buckets_and_auto_state() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)  # offload_layers="auto"
    seen = []
    hook = layers[1].register_forward_hook(lambda m, a, o: seen.append(off.last_step))
    h = _forward(layers, off)
    hook.remove()
    (inside,) = seen
    assert inside.in_progress and inside.open_layer == 1 and not inside.forward_done
    assert list(inside.calls) == [layers[0], layers[1]]
    view = off.last_step
    assert not view.in_progress and view.open_layer is None and not view.aborted
    assert list(view.calls) == list(layers) and view.graph_host_bytes == 0
    # small tensors travel in buckets: one per offloaded call and dtype
    assert all(len(la.buckets) == 1 for la in view.layers[:3]) and not view.layers[3].buckets
    assert sum(b.nbytes for la in view.layers for b in la.buckets) == off.stats.bytes_offloaded
    assert all(b.on_host and not b.poisoned for la in view.layers for b in la.buckets)
    assert view.awaiting_backward == 3 and view.storages_placed > 0
    h.sum().backward()
    assert off.last_step.awaiting_backward == 0
    state = off.last_step.auto_state
    assert state is not None and state.state_size["families"] == len(state.families)
    # a snapshot: its dict is a copy
    state.state_size["families"] = 99
    assert off.last_step.auto_state.state_size["families"] != 99
    off.close()


def test_no_auto_state_without_auto() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    _forward(layers, off).sum().backward()
    assert off.last_step.auto_state is None
    off.close()
