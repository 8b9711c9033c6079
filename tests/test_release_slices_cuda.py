"""Release slices on a CUDA GPU (offload/_scheduler.py, Note [release order], 3): a
group due at the start of layer call ``r`` is released slice by slice while ``r``
runs, each slice after a wait on the D2H event that covers it. A missing or misplaced
wait lets call ``r``'s kernels overwrite blocks a copy still reads, which would change
the reloaded bytes: every run here is compared bitwise. Run with
``PYTHONPATH=. python3 -m pytest -m cuda tests/test_release_slices_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload import _scheduler
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same, twin

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"


class Sleepy(nn.Module):
    """Long kernels around the saves (``cycles=0``: none, same math)."""

    def __init__(self, dim: int, cycles: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.cycles = cycles

    def forward(self, x):
        if self.cycles:
            torch.cuda._sleep(self.cycles)  # the producers finish late
        h = torch.nn.functional.gelu(self.fc1(x))
        y = self.fc2(h * 1.5)
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return x + y


class Tiny(nn.Module):
    """Almost no compute per saved byte: the link is far behind the compute stream, so
    each slice's wait is real and the blocks it frees are reused at once."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x + self.w * torch.sigmoid(x) * torch.tanh(x)


@pytest.fixture
def counted(monkeypatch):
    """A slice after every copy; counts the slices released before their group's last."""
    monkeypatch.setattr(_scheduler, "_SLICE_BYTES", 1)
    monkeypatch.setattr(_scheduler, "_D2H_EAGER_BYTES", 1)
    calls = [0]
    orig = _scheduler.Step._drop_refs

    def drop_refs(self, group, end, last):
        calls[0] += not last
        return orig(self, group, end, last)

    monkeypatch.setattr(_scheduler.Step, "_drop_refs", drop_refs)
    return calls


@pytest.mark.parametrize("kind", ["sleepy", "tiny", "sleepy-fp8", "tiny-fp8"])
def test_slices_stay_exact_under_races(kind, counted) -> None:
    torch.manual_seed(0)
    compress = "fp8" if kind.endswith("fp8") else None
    if kind.startswith("sleepy"):
        layers = nn.ModuleList(Sleepy(256, 2_000_000) for _ in range(6)).to(DEV)
        shape = (8, 256, 256)  # 2-8 MiB per saved tensor
    else:
        layers = nn.ModuleList(Tiny() for _ in range(12)).to(DEV)
        shape = (128, 64, 64)  # 2 MiB per saved tensor, microseconds of compute
    ref = twin(layers)
    if compress is not None:  # the same run without long kernels: other timing
        for m in ref:
            if isinstance(m, Sleepy):
                m.cycles = 0
    k = len(layers) // 2
    off = offload.ActivationOffloader(
        layers, offload_layers=k, min_tensor_bytes=1024, compress=compress
    )
    ref_off = offload.ActivationOffloader(
        ref, offload_layers=k, min_tensor_bytes=1024, compress=compress
    )
    for _ in range(30):
        x = torch.randn(*shape, device=DEV)
        got = models.step(layers, x, models.run_plain, off)
        want = models.step(ref, x, models.run_plain, ref_off if compress else None)
        assert_same(got, want)
        assert all(la.bytes_released > 0 for la in off.stats.layers[:k])
    assert counted[0] >= 30 * k  # slices were released before their group's last one
    off.close()
    ref_off.close()


def test_slices_keep_the_peak() -> None:
    """Releasing during the call instead of at its start frees the same bytes before
    the call saves them: the peak stays that of the whole-group release, within one
    saved tensor (what a call allocates before it saves it)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(Sleepy(1024, 0) for _ in range(8)).to(DEV, torch.bfloat16)
    ref = twin(layers)
    x = torch.randn(16, 1024, 1024, device=DEV, dtype=torch.bfloat16)  # 32 MiB
    largest = 4 * x.nbytes  # fc1's output
    want = models.step(ref, x, models.run_plain)
    peaks = {}
    for name, slice_bytes in [("whole", 1 << 62), ("sliced", 64 << 20)]:
        _scheduler._SLICE_BYTES, saved = slice_bytes, _scheduler._SLICE_BYTES
        try:
            off = offload.ActivationOffloader(layers, offload_layers=4, min_tensor_bytes=1024)
            for _ in range(2):
                got = models.step(layers, x, models.run_plain, off)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            got = models.step(layers, x, models.run_plain, off)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated()
            assert_same(got, want)
            assert off.stats.bytes_released > 0
            off.close()
        finally:
            _scheduler._SLICE_BYTES = saved
    assert peaks["sliced"] <= peaks["whole"] + largest, peaks
