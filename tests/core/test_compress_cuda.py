"""Compressed offload (``compress="fp8"``) on a CUDA GPU: close gradients, half the link
bytes, and no race: the quantize kernel reads each source on the copy stream and the
dequantize kernel writes each reload buffer on the reload stream, so a missing wait
would make results depend on timing. Every compressed run here is compared bitwise
with the same run under different timing (long kernels on the compute stream, another
allocator state). Run with ``PYTHONPATH=. python3 -m pytest -m cuda tests/core/test_compress_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same, twin

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"


class Sleepy(nn.Module):
    """Long kernels before and after the saves (``cycles=0``: none, same math)."""

    def __init__(self, dim: int, cycles: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.cycles = cycles

    def forward(self, x):
        if self.cycles:
            torch.cuda._sleep(self.cycles)  # the producer finishes late: quantize waits
        h = torch.nn.functional.gelu(self.fc1(x))
        y = self.fc2(h * 1.5)
        if self.cycles:
            torch.cuda._sleep(self.cycles)  # later kernels reuse released blocks late
        return x + y


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0))


def test_llama_bf16_close_to_exact_and_half_the_bytes() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(256, 4, 512) for _ in range(4)).to(DEV, torch.bfloat16)
    ref = twin(layers)
    off = offload.ActivationOffloader(
        layers, offload_layers="all", min_tensor_bytes=0, compress="fp8"
    )
    exact = offload.ActivationOffloader(ref, offload_layers="all", min_tensor_bytes=0)
    for _ in range(3):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
        want = models.step(ref, x, models.run_plain)
        assert_same(models.step(ref, x, models.run_plain, exact), want)  # None: bitwise
        got = models.step(layers, x, models.run_plain, off)
        again = models.step(layers, x, models.run_plain, off)
        assert_same(got, again)  # deterministic, whatever the allocator state
        for g_want, g_got in zip(want[1], got[1]):
            assert _cos(g_want, g_got) > 0.99
        stats = off.stats
        ratio = stats.compress_bytes_after / stats.compress_bytes_before
        assert 0.5 < ratio < 0.52
        assert stats.bytes_offloaded < 0.55 * exact.stats.bytes_offloaded
        assert stats.bytes_by_dtype.get("bfloat16 as fp8", 0) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race_stress_timing_does_not_change_results(dtype) -> None:
    torch.manual_seed(0)
    fast = nn.ModuleList(Sleepy(256, 0) for _ in range(6)).to(DEV, dtype)
    slow = twin(fast)
    for layer in slow:
        layer.cycles = 2_000_000
    every = dict(compress="fp8", compress_filter=lambda t: True)  # fp32 compressed too
    off_fast = offload.ActivationOffloader(fast, offload_layers=5, min_tensor_bytes=1024, **every)
    off_slow = offload.ActivationOffloader(slow, offload_layers=5, min_tensor_bytes=1024, **every)
    for _ in range(20):
        x = torch.randn(4, 256, 256, device=DEV, dtype=dtype)
        a = models.step(fast, x, models.run_plain, off_fast)
        b = models.step(slow, x, models.run_plain, off_slow)
        assert_same(a, b)
        assert off_slow.stats.compress_bytes_before > 0


def test_many_chunks_cycle_the_staging_slots(monkeypatch) -> None:
    """Spans of 64 chunks each pass through the staging slots again and again (each
    slot's two events are recorded anew for every chunk, in both directions), with the
    producers and later kernels delayed: the results equal, bitwise, those of the same
    steps with one chunk per span (chunks are whole blocks: the packed bytes are the
    same), so no chunk was quantized into a slot its previous copy still read, sent
    before it was quantized, or dequantized before it arrived."""
    from offload._core import _device

    torch.manual_seed(0)
    ref = nn.ModuleList(Sleepy(256, 0) for _ in range(6)).to(DEV)
    slow = twin(ref)
    for layer in slow:
        layer.cycles = 2_000_000
    every = dict(compress="fp8", compress_filter=lambda t: True, min_tensor_bytes=1024)
    off_ref = offload.ActivationOffloader(ref, offload_layers=5, **every)
    xs = [torch.randn(4, 256, 256, device=DEV) for _ in range(4)]
    want = [models.step(ref, x, models.run_plain, off_ref) for x in xs]
    monkeypatch.setattr(_device, "CHUNK_ELEMENTS", 4096)
    off = offload.ActivationOffloader(slow, offload_layers=5, **every)
    for x, w in zip(xs, want, strict=True):
        assert_same(w, models.step(slow, x, models.run_plain, off))
    assert off.stats.compress_bytes_before >= 64 * 4096 * 4  # a 64-chunk span at least


def test_tiny_layers_copies_dominate() -> None:
    """Microseconds of compute per MiB saved: the codec kernels and copies lag far
    behind the compute stream, and every release and reload waits for them."""

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x + self.w * torch.sigmoid(x) * torch.tanh(x)

    torch.manual_seed(0)
    layers = nn.ModuleList(Tiny() for _ in range(12)).to(DEV)
    ref = twin(layers)
    every = dict(compress="fp8", compress_filter=lambda t: True)  # fp32 compressed too
    off = offload.ActivationOffloader(layers, offload_layers=11, min_tensor_bytes=1024, **every)
    off_ref = offload.ActivationOffloader(ref, offload_layers=11, min_tensor_bytes=1024, **every)
    for i in range(30):
        x = torch.randn(64, 64, 64, device=DEV)
        if i % 2:
            torch.cuda._sleep(1_000_000)  # shift the timing of one of the twins
        a = models.step(layers, x, models.run_plain, off)
        b = models.step(ref, x, models.run_plain, off_ref)
        assert_same(a, b)
    assert off.stats.compress_bytes_before > 0
