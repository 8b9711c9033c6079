"""Nothing piles up across steps: hooks on persistent tensors and live per-forward state.

Model: 8 ``Linear(64, 64)`` layers, each also taking a parameter shared by every layer
(like a RoPE table or a persistent ``inputs_embeds``), and a caller-held input that
requires grad; ``offload_layers="all"``, ``min_tensor_bytes=0``. After many steps the
persistent tensors must carry no backward hook of the offloader and at most the most
recent forward's state may be alive: a hook left behind per layer input per step once
made the backward slow down with the number of steps trained.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

import offload

STEPS = 200


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * shared)


def _live_steps() -> int:
    """Objects of the offloader's per-forward class (``Step``), found by name so that the
    test does not depend on the private module that defines it."""
    return sum(
        1
        for o in gc.get_objects()
        if type(o).__name__ == "Step" and type(o).__module__.startswith("offload.")
    )


def test_no_hooks_or_steps_accumulate_over_many_steps() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(64) for _ in range(8))
    shared = nn.Parameter(torch.rand(64))
    x = torch.randn(16, 64, requires_grad=True)
    ref_layers = nn.ModuleList(Block(64) for _ in range(8))
    ref_layers.load_state_dict(layers.state_dict())
    gc.collect()
    baseline = _live_steps()  # other tests' offloaders may still hold theirs
    offloader = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    offloaded = 0
    for step in range(STEPS):
        h = x
        with offloader:
            for layer in layers:
                h = layer(h, shared)
        if step == 0:
            assert _live_steps() >= baseline + 1  # the count finds the class it looks for
        h.square().mean().backward()
        offloaded = offloader.stats.bytes_offloaded
    gc.collect()
    assert offloaded > 0
    assert len(x._backward_hooks or {}) == 0
    assert len(shared._backward_hooks or {}) == 0
    assert _live_steps() <= baseline + 2  # the latest forward's, at most the prepared next

    # the same number of steps without offloading gives the same gradients
    x_ref = x.detach().clone().requires_grad_(True)
    shared_ref = nn.Parameter(shared.detach().clone())
    for _ in range(STEPS):
        h = x_ref
        for layer in ref_layers:
            h = layer(h, shared_ref)
        h.square().mean().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(shared.grad, shared_ref.grad)
    for p, q in zip(layers.parameters(), ref_layers.parameters()):
        assert torch.equal(p.grad, q.grad)
    offloader.close()
