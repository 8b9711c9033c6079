"""In-place changes to saved tensors raise like autograd does (docs/design.md 4.6)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload


class SaveThenModify(nn.Module):
    def __init__(self, modify: bool, size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(size, size)
        self.modify = modify

    def forward(self, x):
        h = self.fc(x)
        y = h * h  # saves h (twice)
        if self.modify:
            h.add_(1)  # changes a saved tensor
        return y


@pytest.mark.parametrize("where", ["offloaded", "kept"])
def test_inplace_after_save_raises(where: str) -> None:
    size = 64
    layers = nn.ModuleList([SaveThenModify(True, size), SaveThenModify(False, size)])
    off = offload.ActivationOffloader(
        layers, offload_layers=[0] if where == "offloaded" else [], min_tensor_bytes=0
    )
    x = torch.randn(8, size, requires_grad=True)
    with off:
        y = layers[1](layers[0](x))
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_legitimate_inplace_never_raises() -> None:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            h = self.fc(x)
            h = h.relu_()  # relu_ saves its own result
            t = h * 2  # unsaved temporary ...
            t.add_(1)  # ... modified in place
            return t.sigmoid() + h

    layers = nn.ModuleList([Block(), Block()])
    ref = [b for b in layers]  # noqa: F841
    off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
    x = torch.randn(8, 64, requires_grad=True)
    with off:
        y = layers[1](layers[0](x))
    y.sum().backward()
    assert off.stats.bytes_offloaded > 0
    g = x.grad.clone()
    x.grad = None
    y2 = layers[1](layers[0](x))
    y2.sum().backward()
    assert torch.equal(g, x.grad)
