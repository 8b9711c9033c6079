"""Release slices (offload/_scheduler.py, Note [release order], 3): a group due at the
start of layer call ``r`` is released during that call, a slice at a time as the call
saves, each slice after the D2H event that covers it, and the rest when the call closes.
The CUDA half of these checks is ``tests/test_release_slices_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from offload import _scheduler
from tests.models import assert_same, twin

DIM = 512
ROWS = 1024  # 2 MiB per float32 activation: above the gathering limit, so no buckets


class Chain(nn.Module):
    """``n`` products, each followed by tanh: saves its input and every tanh output.
    ``hook(i)``, when set, runs after the i-th product."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5) for _ in range(n))
        self.hook = None
        self.outs: list[StorageWeakRef] = []  # each tanh output's storage
        self.keep: int | None = None  # the index of a tanh output to hold on to
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.outs = []
        for i, w in enumerate(self.w):
            x = torch.tanh(x @ w)
            self.outs.append(StorageWeakRef(x.untyped_storage()))
            if i == self.keep:
                self.kept = x
            if self.hook is not None:
                self.hook(i)
        return x


def run(layers, x, off=None):
    for p in layers.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    ctx = off if off is not None else torch.enable_grad()
    with ctx:
        y = x
        for layer in layers:
            y = layer(y)
        loss = y.square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in layers.parameters()], x.grad.clone()


@pytest.fixture
def sliced(monkeypatch):
    """Every copy issued at once, and a release slice after each."""
    monkeypatch.setattr(_scheduler, "_SLICE_BYTES", 1)
    monkeypatch.setattr(_scheduler, "_D2H_EAGER_BYTES", 1)


def test_a_group_is_released_as_the_release_call_saves(sliced) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(Chain(6) for _ in range(4))
    ref = twin(layers)
    # k = 1: group 0 is due at the start of call 3 (L - k + 0)
    off = offload.ActivationOffloader(layers, offload_layers=[0], min_tensor_bytes=0)
    seen: list[tuple[int, int, int]] = []  # (after product i, bytes released, outs alive)

    def probe(i: int) -> None:
        stats = off._last.groups[0].stats  # the live counters of this forward
        alive = sum(not r.expired() for r in layers[0].outs)
        seen.append((i, stats.bytes_released, alive))

    for _ in range(2):
        x = torch.randn(ROWS, DIM)
        seen.clear()
        layers[3].hook = probe
        got = run(layers, x, off)
        layers[3].hook = None
        assert_same(got, run(ref, x))
        total = off.stats.layers[0].bytes_released
        assert off.stats.layers[0].bytes_offloaded > 0 and total > 0
        released = [b for _, b, _ in seen]
        alive = [a for _, _, a in seen]
        # released during call 3, slice by slice: more after each save, never all at once
        assert released == sorted(released) and 0 < released[0] < total, seen
        assert alive == sorted(alive, reverse=True) and alive[0] < 6 and alive[-1] < alive[0]
        # what call 3 saved so far is covered (its input and one tanh output per
        # product), and one tensor ahead
        act = ROWS * DIM * 4
        for i, b, _ in seen:
            assert b >= min(total, (i + 3) * act), seen
    off.close()


def test_slices_keep_gradients_and_inplace_checks(sliced) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(Chain(6) for _ in range(5))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=3, min_tensor_bytes=0)
    for _ in range(3):
        x = torch.randn(ROWS, DIM)
        got = run(layers, x, off)
        assert_same(got, run(ref, x))
        assert all(la.bytes_released > 0 for la in off.stats.layers[:3])

    # A saved activation of group 0 changed in place during call 2 (group 0's release
    # call, k=3 of 5) before the slice that holds it is released: that release sees it.
    # Call 2's start released one tensor ahead (the largest of group 0: one activation),
    # its first two saves two more: the slices of group 0's input (held by the caller:
    # frees nothing) and of its first three tanh outputs.
    def poke(i: int) -> None:
        if i == 0:
            assert off._last.groups[0].stats.bytes_released == 3 * ROWS * DIM * 4
            with torch.no_grad():
                layers[0].kept.mul_(2)

    layers[0].keep = 4
    layers[2].hook = poke
    x = torch.randn(ROWS, DIM)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(layers, x, off)
    layers[2].hook = None
    layers[0].keep = layers[0].kept = None
    assert_same(run(layers, x, off), run(ref, x))  # and the next step is fine
    off.close()


def test_an_exception_during_the_release_call_frees_everything(sliced) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(Chain(4) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)

    def fail(i: int) -> None:
        if i == 1:
            raise ValueError("boom")

    layers[2].hook = fail  # group 0 is released during call 2, group 1 during call 3
    with pytest.raises(ValueError, match="boom"):
        run(layers, torch.randn(ROWS, DIM), off)
    layers[2].hook = None
    stats = off.stats
    assert stats.layers[0].bytes_released > 0 and stats.bytes_offloaded > 0
    assert stats.host_pool_bytes == 0  # every host block returned
    assert not off._last.releasing
    x = torch.randn(ROWS, DIM)
    assert_same(run(layers, x, off), run(ref, x))
    off.close()
