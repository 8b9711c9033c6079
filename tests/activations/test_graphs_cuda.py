"""Offloading inside CUDA graphs on the GPU: a whole training step (forward and
backward) captured in one graph with the offloader entered inside the capture, and
per-layer graphs from ``offload.make_graphed_callables``. Each is replayed 20 times on
fresh inputs and compared bitwise with the eager step without offloading and with the
same graphs captured without offloading; the pool's host bytes must not move across
replays, and the capture must hold less device memory than without offloading.
Run with ``PYTHONPATH=. python3 -m pytest -m cuda tests/activations/test_graphs_cuda.py``."""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import pytest
import torch
from torch import nn

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, twin

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"
SHAPE = (2, 512, 256)
REPLAYS = 20


def llama(n: int = 4) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(models.LlamaBlock(256, 4, 512) for _ in range(n)).to(DEV, torch.bfloat16)


def forward_loss(layers, x: torch.Tensor, off=None) -> torch.Tensor:
    with off if off is not None else contextlib.nullcontext():
        h = x
        for layer in layers:
            h = layer(h)
    return h.float().square().mean()


def eager_grads(layers, x: torch.Tensor) -> list[torch.Tensor]:
    for p in layers.parameters():
        p.grad = None
    forward_loss(layers, x).backward()
    return [p.grad.clone() for p in layers.parameters()]


PACKAGE = os.path.dirname(offload.__file__)


def python_of_ours(fn) -> list[str]:
    """The functions of the offload package that run while ``fn()`` runs."""
    seen: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def capture_step(
    layers, static_x: torch.Tensor, off=None, loss_fn=None
) -> tuple[torch.cuda.CUDAGraph, int]:
    """PyTorch's whole-network recipe: warm up on a side stream, then capture forward
    and backward in one graph; the offloader is entered inside the capture
    (``loss_fn(x)``, default ``forward_loss(layers, x, off)``, may enter its own).
    Returns the graph and the device bytes its capture peaked at above what was
    allocated before."""
    if loss_fn is None:
        loss_fn = functools.partial(forward_loss, layers, off=off)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for p in layers.parameters():
                p.grad = None
            loss_fn(static_x).backward()
    torch.cuda.current_stream().wait_stream(side)
    for p in layers.parameters():
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_fn(static_x).backward()
    return graph, torch.cuda.max_memory_allocated() - base


def assert_replays_match(graph, static_x: torch.Tensor, layers, ref, replays: int) -> None:
    """``replays`` replays on fresh inputs copied into ``static_x``: the gradients of
    ``layers`` equal (bitwise) those of the eager step of ``ref`` on the same input."""
    for _ in range(replays):
        x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        got = [p.grad.clone() for p in layers.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, eager_grads(ref, x)))


@pytest.mark.parametrize("selection", ["all", 2])
def test_whole_step_graph_bitwise_over_replays(selection) -> None:
    layers = llama()
    plain = twin(layers)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=selection, min_tensor_bytes=0)
    static_x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16)
    static_plain = static_x.clone()
    # a first capture allocates the capture stream's cuBLAS and attention workspaces;
    # the two captures compared below both find them made
    capture_step(twin(layers), static_x.clone())
    graph, peak = capture_step(layers, static_x, off)
    graph_plain, peak_plain = capture_step(plain, static_plain)
    stats = off.stats
    assert off.last_step.capture == "step"
    offloaded = [s.index for s in stats.layers if s.bytes_offloaded > 0]
    assert offloaded == ([0, 1, 2] if selection == "all" else [0, 1])
    assert stats.bytes_reloaded == stats.bytes_offloaded
    assert stats.bytes_released > 0
    # the capture itself holds less device memory: offloaded blocks were reused in it
    assert peak < peak_plain - stats.bytes_released // 2, (peak, peak_plain)
    host = off.stats  # the host pool's figures, read again after the replays
    before = (host.host_pool_bytes, host.host_pool_reserved_bytes)
    assert before[0] >= stats.bytes_offloaded
    for _ in range(REPLAYS):
        x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16)
        static_x.copy_(x)
        static_plain.copy_(x)
        assert python_of_ours(graph.replay) == []  # nothing of ours runs on replay
        graph_plain.replay()
        got = [p.grad.clone() for p in layers.parameters()]
        control = [p.grad.clone() for p in plain.parameters()]
        want = eager_grads(ref, x)
        assert all(torch.equal(a, b) for a, b in zip(control, want))  # control
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.cuda.synchronize()
    host = off.stats
    assert (host.host_pool_bytes, host.host_pool_reserved_bytes) == before
    # the offloader still works eagerly afterwards, beside the graph's host blocks
    x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16)
    want = eager_grads(ref, x)
    for p in layers.parameters():
        p.grad = None
    forward_loss(layers, x, off).backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(layers.parameters(), want))
    assert off.stats.bytes_offloaded > 0 and off.last_step.capture is None
    del graph
    off.close()
    assert off.free_graph_memory() > 0
    assert off.last_step.graph_host_bytes == 0


def test_whole_step_graph_races_slow_copies() -> None:
    """A long kernel before every layer delays the copies' producers: replays must
    still wait for each copy (the graph keeps the event edges)."""
    layers = llama(3)
    ref = twin(layers)

    class Slow(nn.Module):
        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.cuda._sleep(200_000)
            return self.layer(x)

    slow = nn.ModuleList(Slow(la) for la in layers)
    off = offload.ActivationOffloader(list(slow), offload_layers="all", min_tensor_bytes=0)
    static_x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16)
    graph, _ = capture_step(slow, static_x, off)
    assert_replays_match(graph, static_x, slow, ref, 5)
    assert off.stats.bytes_offloaded > 0
    del graph
    off.close()


def test_per_layer_graphed_callables_bitwise_over_replays() -> None:
    layers = llama()
    plain = twin(layers)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=[0, 1, 3], min_tensor_bytes=0)

    def samples() -> tuple:
        torch.manual_seed(1)
        return tuple(
            (torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16, requires_grad=True),)
            for _ in layers
        )

    graphed = offload.make_graphed_callables(tuple(layers), samples(), offloader=off)
    graphed_plain = torch.cuda.make_graphed_callables(tuple(plain), samples())
    stats = off.stats
    assert [s.index for s in stats.layers] == [0, 1, 2, 3]
    assert [s.bytes_offloaded > 0 for s in stats.layers] == [True, True, False, True]
    assert stats.bytes_reloaded == stats.bytes_offloaded
    host = off.stats  # the host pool's figures, read again after the replays
    before = (host.host_pool_bytes, host.host_pool_reserved_bytes)
    assert before[0] >= stats.bytes_offloaded > 0

    def grads(callables, params, x: torch.Tensor) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        h = x
        for c in callables:
            h = c(h)
        h.float().square().mean().backward()
        return [p.grad.clone() for p in params]

    for _ in range(REPLAYS):
        x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        want = eager_grads(ref, x.detach())
        control = grads(graphed_plain, list(plain.parameters()), x)
        got: list[torch.Tensor] = []
        ours = python_of_ours(
            functools.partial(
                lambda out, xi: out.extend(grads(graphed, list(layers.parameters()), xi)), got, x
            )
        )
        assert ours == [], ours  # the replays run no code of the package
        assert all(torch.equal(a, b) for a, b in zip(control, want))  # control
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.cuda.synchronize()
    host = off.stats
    assert (host.host_pool_bytes, host.host_pool_reserved_bytes) == before
    off.close()


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"])
def test_whole_step_graph_attention_backends(backend: str) -> None:
    """TransformerEngine tests graphs x attention backends; the same here: each SDPA
    backend, captured with offloading, replays bitwise equal to its eager step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layers = llama(3)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    static_x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        graph, _ = capture_step(layers, static_x, off)
        assert_replays_match(graph, static_x, layers, ref, 5)
    assert off.stats.bytes_offloaded > 0
    del graph
    off.close()


def test_te_style_context_inside_a_whole_step_graph() -> None:
    """``get_cpu_offload_context`` (TransformerEngine's API) entered per layer inside a
    capture, ``retain_pinned_cpu_buffers=True`` as TE's graph recipe passes it."""
    layers = llama(4)
    ref = twin(layers)
    ctx, sync = offload.get_cpu_offload_context(
        True, num_layers=2, model_layers=4, retain_pinned_cpu_buffers=True
    )

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in layers:
            with ctx:
                h = layer(h)
            h = sync(h)
        return h.float().square().mean()

    static_x = torch.randn(SHAPE, device=DEV, dtype=torch.bfloat16)
    graph, _ = capture_step(layers, static_x, loss_fn=loss_of)
    assert ctx.step.capture == "step"
    assert ctx.stats.bytes_offloaded > 0
    pool = ctx.runtime.pool
    before = (pool.in_use_bytes, pool.reserved_bytes)
    assert_replays_match(graph, static_x, layers, ref, REPLAYS)
    torch.cuda.synchronize()
    assert (pool.in_use_bytes, pool.reserved_bytes) == before
