"""Gathered copies on a CUDA GPU (Note [release order], 1(b)): a bucket's flat copy is
not reused by the allocator before its D2H copy has read it, and the memory and results
are those of the same model without offloading.
Run with ``PYTHONPATH=. python3 -m pytest -m cuda tests/activations/test_gather_cuda.py``."""

from __future__ import annotations

import torch
from torch import nn

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same, twin

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"


class BigThenSmall(nn.Module):
    """Saves one 64 MiB tensor (a copy of its own, 1.2 ms on a PCIe Gen5 link) and then
    many small ones (a bucket), so the bucket's D2H queues behind the big copy; then
    allocates and writes small tensors of the bucket's size, which a block freed too
    early would receive while the copy still has to read it."""

    def __init__(self, dim: int = 256) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x.repeat(1, 256, 1)  # 64 MiB in fp32 for x of 1 x 256 x 256
        y = torch.sin(big).mean(1, keepdim=True)  # saves big
        h = self.fc(x + y)
        for _ in range(8):
            h = torch.sin(h)  # saves 8 small tensors (256 KiB each)
        torch.cuda._sleep(1000)
        return h


def test_bucket_flat_copy_survives_until_its_d2h() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(BigThenSmall() for _ in range(6)).to(DEV)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=5, min_tensor_bytes=0)
    for it in range(3):
        x = torch.randn(1, 256, 256, device=DEV) + it
        got = models.step(layers, x, models.run_plain, off)
        assert_same(got, models.step(ref, x, models.run_plain))
        buckets = [b for la in off.last_step.layers for b in la.buckets]
        assert buckets and off.stats.bytes_offloaded > 5 * (64 << 20)


def test_small_tensor_model_frees_memory_and_matches() -> None:
    """Many layers of small tensors only (every saved tensor gathered): the same
    gradients, and the device memory the graph holds after the forward (its saved
    activations) a fraction of the model's without offloading."""
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(256, 4, 512) for _ in range(12)).to(
        DEV, torch.bfloat16
    )
    ref = twin(layers)
    x = torch.randn(2, 128, 256, device=DEV, dtype=torch.bfloat16)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)

    def held(offloader: offload.ActivationOffloader | None, mods: nn.ModuleList) -> tuple:
        for p in mods.parameters():
            p.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        after: list[int] = []

        def record() -> None:
            torch.cuda.synchronize()
            after.append(torch.cuda.memory_allocated() - base)

        out = models.step(mods, x, models.run_plain, offloader, after_forward=record)
        return out, after[0]

    for _ in range(2):
        got, with_off = held(off, layers)
        want, without = held(None, ref)
        assert_same(got, want)
    buckets = [b for la in off.last_step.layers for b in la.buckets]
    assert buckets
    assert all(b.nbytes <= 8 << 20 for b in buckets)
    # 11 of 12 layers offloaded: what stays is the last layer's and the loss's
    assert with_off < 0.25 * without, (with_off, without)
