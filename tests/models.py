"""Small models shared by the tests: each block records a weak reference to the storage
of one large activation it saves for backward, so tests can check that offloaded
originals are really freed (Note [release order], 3). Also the ``pytestmark`` of the
GPU test files (:data:`ON_CUDA`, :data:`ON_CUDA_DETERMINISTIC`)."""

from __future__ import annotations

import contextlib  # noqa: F401  (re-exported for tests)
import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

#: ``pytestmark`` of a GPU test file: its tests are marked ``cuda`` and skip with a
#: reason on a machine without a GPU ...
ON_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
#: ... and, for bitwise comparisons, run with deterministic algorithms (the
#: ``cuda_deterministic`` fixture of tests/conftest.py; tests/conftest.py also sets the
#: cuBLAS workspace that determinism needs, before any test file is imported)
ON_CUDA_DETERMINISTIC = [*ON_CUDA, pytest.mark.usefixtures("cuda_deterministic")]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """RMSNorm, fused QKV, causal SDPA, out-proj, RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int = 64, heads: int = 4, ffn: int = 128) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm2 = RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)
        self.probe: StorageWeakRef | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        h = F.silu(gate) * up  # saved by `down`
        if not torch.compiler.is_compiling():
            self.probe = StorageWeakRef(h.untyped_storage())
        return x + self.down(h)


class KwargsBlock(nn.Module):
    """Takes keyword arguments and returns a tuple (HF style)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.probe: StorageWeakRef | None = None

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0):
        h = torch.tanh(self.fc1(x)) * mask
        self.probe = StorageWeakRef(h.untyped_storage())
        y = x + scale * self.fc2(h)
        return y, {"aux": h.mean()}


class InplaceBlock(nn.Module):
    """Modifies its own output in place (residual added with ``+=``)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.probe: StorageWeakRef | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.fc1(x))
        self.probe = StorageWeakRef(h.untyped_storage())
        out = self.fc2(h)
        out += x
        return out


def encoder_layers(n: int, dim: int = 32) -> nn.ModuleList:
    return nn.ModuleList(
        nn.TransformerEncoderLayer(dim, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        for _ in range(n)
    )


# ---- how each kind of stack is run -------------------------------------------------------


def run_plain(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def run_between(kind: str) -> Callable[[Sequence[nn.Module], torch.Tensor], torch.Tensor]:
    """A runner with an op between the layer calls that saves a tensor for backward:
    ``"activation"`` (relu on each layer's output) or ``"norm"`` (a layer norm before
    each layer, outside it, with the residual around it)."""

    def run(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            if kind == "activation":
                x = torch.relu(layer(x))
            else:
                x = x + layer(torch.nn.functional.layer_norm(x, x.shape[-1:]))
        return x

    return run


def assert_reloaded_once(stats: Any, backwards: int) -> None:
    """Something was sent, and one backward brought every byte back once (Note [release
    order], 6); a second backward of a retained graph reloads only what it needs again."""
    assert stats.bytes_offloaded > 0
    if backwards == 1:
        assert stats.bytes_reloaded == stats.bytes_offloaded
    else:
        assert stats.bytes_offloaded < stats.bytes_reloaded <= 2 * stats.bytes_offloaded


def run_kwargs(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    mask = (torch.arange(x.shape[-1] * 4, device=x.device) % 3 != 0).to(x.dtype)
    aux = 0
    for layer in layers:
        x, extra = layer(x, mask=mask, scale=0.5)
        aux = aux + extra["aux"]
    return x + aux


def run_inplace_outside(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
        x.mul_(0.5)  # in place on a layer output, after its backward trigger was set
    return x


def run_checkpointed(
    layers: Sequence[nn.Module], x: torch.Tensor, reentrant: bool = True
) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    for layer in layers:  # HF pattern: checkpoint around the module's __call__
        x = checkpoint(layer.__call__, x, use_reentrant=reentrant)
    return x


def step(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    runner: Callable[[Sequence[nn.Module], torch.Tensor], torch.Tensor],
    offloader: Any = None,
    *,
    retain_graph: bool = False,
    backwards: int = 1,
    after_forward: Callable[[], None] | None = None,
    after_backward: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One forward (under ``offloader`` when given) and ``backwards`` backwards;
    ``after_forward`` runs between them (the graph is alive, the context exited),
    ``after_backward`` after each backward."""
    for p in _params(layers):
        p.grad = None
    x = x.clone().requires_grad_(True)
    with offloader if offloader is not None else contextlib.nullcontext():
        loss = runner(layers, x).float().square().mean()
    if after_forward is not None:
        after_forward()
    for i in range(backwards):
        loss.backward(retain_graph=retain_graph or i < backwards - 1)
        if after_backward is not None:
            after_backward()
    return loss.detach(), [p.grad.clone() for p in _params(layers)], x.grad.clone()


def check_released(layers: Sequence[nn.Module], selected: Sequence[int]) -> None:
    """The probed activation of each selected layer is freed once the forward is over;
    that of every other layer is still alive (saved on the device)."""
    for i, layer in enumerate(layers):
        probe = getattr(layer, "probe", None)
        if probe is None:
            continue
        assert probe.expired() == (i in selected), (i, selected)


def _params(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for layer in layers for p in layer.parameters()]


def assert_same(a: tuple, b: tuple) -> None:
    """Loss, every parameter gradient and the input gradient are bitwise equal."""
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert len(a[1]) == len(b[1]) and len(a[1]) > 0
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        assert torch.equal(ga, gb), f"gradient {i} differs: max {(ga - gb).abs().max()}"
    assert torch.equal(a[2], b[2])


def twin(layers: nn.ModuleList) -> nn.ModuleList:
    return copy.deepcopy(layers)
