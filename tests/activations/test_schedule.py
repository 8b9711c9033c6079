"""The release/reload formulas of docs/design.md, section 3 and the TransformerEngine-style
manual API."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import offload
from offload.activations._schedule import make_plan
from tests import models
from tests.models import assert_same, twin


def test_release_and_reload_points() -> None:
    # k = L - 1: each group goes right after it ends and comes back one layer ahead
    p = make_plan(8, list(range(7)), None)
    assert p.release_at == {j + 1: (j,) for j in range(7)}
    assert p.reload_at == {j + 1: (j,) for j in range(7)}
    # k = 1 (TE v2 rule): released at the start of layer 7, reloaded at layer 6's backward
    p = make_plan(8, [0], None)
    assert p.release_at == {7: (0,)}
    assert p.reload_at == {6: (0,)}
    # k = 2
    p = make_plan(8, [0, 1], None)
    assert p.release_at == {6: (0,), 7: (1,)}
    assert p.reload_at == {5: (0,), 6: (1,)}
    # the last layer offloaded: released when the forward ends, reloaded when backward starts
    p = make_plan(4, [0, 1, 2, 3], None)
    assert 3 not in sum(p.release_at.values(), ())
    assert p.reload_at[3] == (3, 2)
    # prefetch_layers=n: reload when the backward of layer s + n starts
    p = make_plan(8, [0, 3], 2)
    assert p.reload_at == {2: (0,), 5: (3,)}


def test_resident_bound_holds() -> None:
    """At most L - k offloaded-or-not groups hold device references at any layer start."""
    for L in range(1, 10):
        for k in range(L + 1):
            p = make_plan(L, list(range(k)), None)
            released: set[int] = set()
            for r in range(L):
                released |= set(p.release_at.get(r, ()))
                resident = r - len(released)  # groups 0..r-1 still on the device
                assert resident <= max(L - k, 1), (L, k, r)
                assert all(g < r for g in p.release_at.get(r, ()))


def _te_run(layers, x, ctx=None, sync=None):
    for p in layers.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    for layer in layers:
        with ctx if ctx is not None else contextlib.nullcontext():
            x = layer(x)
        if sync is not None:
            x = sync(x)
    loss = x.square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in layers.parameters()], None


def test_te_context_same_gradients_over_steps() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    ref = twin(layers)
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=2, model_layers=4)
    for _it in range(3):
        x = torch.randn(2, 1024, 64)  # the TE API keeps the default 256 KiB threshold
        got = _te_run(layers, x, ctx, sync)
        want = _te_run(ref, x)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        stats = ctx.stats
        assert [la.offloaded for la in stats.layers] == [True, True, False, False]
        assert stats.layers[0].bytes_offloaded > 0 and stats.layers[1].bytes_offloaded > 0
        assert stats.bytes_reloaded == stats.bytes_offloaded


def test_te_context_arguments() -> None:
    ctx, sync = offload.get_cpu_offload_context()
    assert isinstance(ctx, contextlib.nullcontext)
    t = torch.ones(1)
    assert sync(t) is t
    with pytest.raises(ValueError, match="num_layers"):
        offload.get_cpu_offload_context(True, num_layers=4, model_layers=4)
    ctx, sync = offload.get_cpu_offload_context(True, 1, 2, offload_weights=True)
    assert isinstance(ctx.weights, offload.WeightOffloader)  # tests/weights/test_weights.py uses it
    with pytest.raises(TypeError, match="num_layers"):
        offload.get_cpu_offload_context(True, num_layers="1", model_layers=2)
    with pytest.raises(TypeError, match="enabled"):
        offload.get_cpu_offload_context(1, 1, 2)


def test_prefetch_layers_same_gradients() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(5))
    ref = twin(layers)
    x = torch.randn(2, 16, 64)
    for n in (1, 2, 4):
        off = offload.ActivationOffloader(layers, prefetch_layers=n, min_tensor_bytes=1024)
        got = models.step(layers, x, models.run_plain, off)
        assert_same(got, models.step(ref, x, models.run_plain))
        assert off.stats.bytes_reloaded == off.stats.bytes_offloaded > 0


def test_double_buffering_reuses_buffers_and_stays_exact() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(6))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, double_buffering=True, min_tensor_bytes=1024)
    for backwards in (1, 2, 1):
        x = torch.randn(2, 16, 64)
        got = models.step(layers, x, models.run_plain, off, backwards=backwards)
        assert_same(got, models.step(ref, x, models.run_plain, backwards=backwards))
        assert off.stats.bytes_reloaded == backwards * off.stats.bytes_offloaded > 0
        # equal-signature groups took over the buffers of groups whose backward ended
        assert off.last_step.double_buffer_reuses > 0
        assert off.last_step.spare_buffers == 0  # freed when the backward ended


def test_double_buffering_never_reuses_a_referenced_buffer() -> None:
    """An output that is a view of a reloaded tensor keeps that buffer out of reuse."""
    kept = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            kept.append(x[:1])  # a view of the reloaded buffer outlives the node
            return g * 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return Keep.apply(torch.tanh(x) * self.w)

    layers = nn.ModuleList(Block() for _ in range(4))
    off = offload.ActivationOffloader(layers, double_buffering=True, min_tensor_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = x
        for layer in layers:
            y = layer(y)
    y.sum().backward()
    values = [k.clone() for k in kept]
    assert len({k.untyped_storage().data_ptr() for k in kept}) == len(kept)
    assert all(torch.equal(a, b) for a, b in zip(kept, values))
