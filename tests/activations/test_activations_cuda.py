"""ActivationOffloader on a CUDA GPU: bitwise-equal gradients in bf16, races, streams,
torch.compile, no host syncs, memory really freed, no growth. Run on the GPU with
``PYTHONPATH=. python3 -m pytest -m cuda tests/activations/test_activations_cuda.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same, twin

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"


def llama(n: int = 4, dim: int = 256, heads: int = 4, ffn: int = 512) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(models.LlamaBlock(dim, heads, ffn) for _ in range(n)).to(
        DEV, torch.bfloat16
    )


def run(layers, x, off=None, runner=models.run_plain, **kw):
    return models.step(layers, x, runner, off, **kw)


@pytest.mark.parametrize(
    ("selection", "selected"),
    [(None, [0, 1, 2]), (0, []), (2, [0, 1]), ([1, 3], [1, 3]), ("callable", [0, 2, 3])],
)
def test_bf16_same_gradients(selection, selected) -> None:
    layers = llama()
    ref = twin(layers)
    sel = (lambda i, m: i != 1) if selection == "callable" else selection
    off = offload.ActivationOffloader(layers, offload_layers=sel, min_tensor_bytes=0)
    for _it in range(3):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
        want = run(ref, x)
        assert_same(run(ref, x), want)  # control: the reference itself is deterministic
        got = run(layers, x, off, after_forward=lambda: models.check_released(layers, selected))
        assert_same(got, want)
        stats = off.stats
        for la in stats.layers:
            assert (la.bytes_offloaded > 0) == la.offloaded
        assert stats.bytes_reloaded == stats.bytes_offloaded
        # bf16 activations, plus SDPA's fp32 logsumexp and its uint64 RNG state
        assert sum(stats.bytes_by_dtype.values()) == stats.bytes_offloaded
        assert (stats.bytes_by_dtype.get("bfloat16", 0) > 0) == (stats.bytes_offloaded > 0)
    off.close()


@pytest.mark.parametrize("kind", ["activation", "norm"])
def test_saves_between_layer_calls_reloaded_once_bf16(kind) -> None:
    # Note [release order], 6 on the device: an op between two calls (an activation on
    # each layer's output, or a pre-norm outside the layer) saves a tensor that joins the
    # next call's group and is used after that group's backward; its buffer is kept for
    # it (no second reload on demand), under a retained graph too, and given up after
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(6)).to(DEV, torch.bfloat16)
    ref = twin(layers)
    runner = models.run_between(kind)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    for backwards in (1, 1, 2):
        x = torch.randn(4, 2048, 1024, device=DEV, dtype=torch.bfloat16)
        want = run(ref, x, runner=runner, backwards=backwards)
        assert_same(run(ref, x, runner=runner, backwards=backwards), want)  # control
        got = run(layers, x, off, runner=runner, backwards=backwards)
        assert_same(got, want)
        models.assert_reloaded_once(off.stats, backwards)
    off.close()


@pytest.mark.parametrize("kind", ["kwargs", "inplace", "checkpoint", "encoder"])
def test_other_blocks_same_gradients(kind) -> None:
    torch.manual_seed(0)
    if kind == "kwargs":
        layers, runner, dim = (
            nn.ModuleList(models.KwargsBlock(128) for _ in range(4)),
            models.run_kwargs,
            128,
        )
    elif kind == "inplace":
        layers, runner, dim = (
            nn.ModuleList(models.InplaceBlock(128) for _ in range(4)),
            models.run_inplace_outside,
            128,
        )
    elif kind == "checkpoint":
        layers, runner, dim = (
            nn.ModuleList(models.LlamaBlock(128) for _ in range(4)),
            models.run_checkpointed,
            128,
        )
    else:
        layers, runner, dim = models.encoder_layers(4, 32), models.run_plain, 32
    layers = layers.to(DEV, torch.bfloat16)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    for _ in range(3):
        x = torch.randn(2, 256, dim, device=DEV, dtype=torch.bfloat16)
        want = run(ref, x, runner=runner)
        assert_same(run(ref, x, runner=runner), want)
        assert_same(run(layers, x, off, runner=runner), want)
        first = 1 if kind == "checkpoint" else 0
        assert all(la.bytes_offloaded > 0 for la in off.stats.layers[first:3])


def test_micro_batches_and_retain_graph() -> None:
    layers = llama()
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
    assert_same(run(layers, x, off, backwards=2), run(ref, x, backwards=2))
    assert off.stats.bytes_reloaded == 2 * off.stats.bytes_offloaded > 0

    xs = [torch.randn_like(x) for _ in range(2)]

    def two(ls, o):
        for p in ls.parameters():
            p.grad = None
        losses = []
        for xi in xs:
            with o if o is not None else contextlib.nullcontext():
                losses.append(models.run_plain(ls, xi).float().square().mean())
        for loss in losses:
            loss.backward()
        return [p.grad.clone() for p in ls.parameters()]

    for a, b in zip(two(layers, off), two(ref, None)):
        assert torch.equal(a, b)


class Sleepy(nn.Module):
    """Long kernels around every save: a missing wait shows up as wrong values."""

    def __init__(self, dim: int, cycles: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.cycles = cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)  # the producer of h finishes late (4.1(a))
        h = torch.relu(self.fc1(x))
        y = self.fc2(h * 1.5)
        torch.cuda._sleep(self.cycles)  # later kernels reuse released blocks late (4.1(b))
        return x + y


class Tiny(nn.Module):
    """Almost no compute per saved byte: copies dominate (4.1(c), (e))."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x + self.w * torch.sigmoid(x) * torch.tanh(x)


@pytest.mark.parametrize("kind", ["sleepy", "tiny", "tiny-double-buffering"])
def test_race_stress_50_steps(kind) -> None:
    torch.manual_seed(0)
    if kind == "sleepy":
        layers = nn.ModuleList(Sleepy(256, 2_000_000) for _ in range(6)).to(DEV)
        shape = (4, 256, 256)
    else:
        layers = nn.ModuleList(Tiny() for _ in range(12)).to(DEV)
        shape = (64, 64, 64)  # 1 MiB per saved tensor, microseconds of compute
    ref = twin(layers)
    off = offload.ActivationOffloader(
        layers,
        min_tensor_bytes=1024,
        offload_layers=len(layers) - 1,
        double_buffering=kind.endswith("double-buffering"),
    )
    for _ in range(50):
        x = torch.randn(*shape, device=DEV)
        got = run(layers, x, off)
        want = run(ref, x)
        assert_same(got, want)
        assert all(la.bytes_offloaded > 0 for la in off.stats.layers[:-1])


def test_non_default_current_stream() -> None:
    layers = llama()
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    side = torch.cuda.Stream()
    for _ in range(3):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
        want = run(ref, x)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000)  # the side stream runs late: waits must be on it
            got = run(layers, x, off)
        torch.cuda.current_stream().wait_stream(side)
        assert_same(got, want)
        assert off.stats.bytes_offloaded > 0


def test_one_layer_under_torch_compile() -> None:
    layers = llama(n=3)
    ref = twin(layers)
    layers[1] = torch.compile(layers[1])  # OptimizedModule: hooks fire on the wrapper
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    torch.use_deterministic_algorithms(False)  # inductor kernels; compared with tolerance
    for _ in range(2):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
        got = run(layers, x, off)
        want = run(ref, x)
        assert torch.allclose(got[0], want[0], rtol=2e-2, atol=1e-2)
        for a, b in zip(got[1], want[1]):
            assert torch.allclose(a.float(), b.float(), rtol=5e-2, atol=5e-2)
        # the compiled layer's saved tensors reach the hooks and are offloaded
        assert off.stats.layers[1].bytes_offloaded > 0
    # bitwise against the same compiled layer without offloading
    plain = run(layers, x)
    again = run(layers, x, off)
    assert_same(again, plain)


def test_no_host_sync_and_no_new_pinned_memory_in_steady_state() -> None:
    layers = llama()
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):
        run(layers, x, off)
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()
    reserved = off.stats.host_pool_reserved_bytes
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for p in layers.parameters():
                p.grad = None
            with off:
                loss = models.run_plain(layers, x).float().square().mean()
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = torch.cuda.host_memory_stats()
    for key in before:
        if "alloc" in key and "current" not in key and "peak" not in key and "bytes" not in key:
            assert before[key] == after[key], (key, before[key], after[key])
    assert off.stats.host_pool_reserved_bytes == reserved
    assert off.stats.bytes_offloaded > 0


def _peak(layers, x, off=None) -> int:
    """Peak allocated during one step above what was allocated before it. Gradients are
    zeroed, not freed, so backward allocates none: the peak is the activations' own."""
    for p in layers.parameters():
        if p.grad is not None:
            p.grad.zero_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with off if off is not None else contextlib.nullcontext():
        loss = models.run_plain(layers, x).float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_peak_memory_drops_by_offloaded_bytes() -> None:
    layers = llama(n=8, dim=512, heads=8, ffn=1536)
    x = torch.randn(2, 2048, 512, device=DEV, dtype=torch.bfloat16)
    for k in (1, 2):
        off = offload.ActivationOffloader(layers, offload_layers=k)
        for _ in range(2):  # warm up the allocator, the pool, cuBLAS; creates the grads
            _peak(layers, x)
            _peak(layers, x, off)
        without = _peak(layers, x)
        with_ = _peak(layers, x, off)
        freed = off.stats.bytes_released
        saved = without - with_
        # With k = 1 or 2 of 8, every offloaded group is off the device at the step's
        # peak (the start of backward) and comes back only a few layers later: the peak
        # drops by what the releases freed, within 5 %.
        assert 0 < freed <= off.stats.bytes_offloaded
        assert abs(saved - freed) <= 0.05 * freed, (k, saved, freed, without, with_)
        off.close()


def test_200_steps_no_growth() -> None:
    layers = llama(n=4, dim=128, heads=4, ffn=256)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    allocated, pool = [], []
    for i in range(200):
        x = torch.randn(2, 128, 128, device=DEV, dtype=torch.bfloat16)
        run(layers, x, off)
        if i >= 10:
            allocated.append(torch.cuda.memory_allocated())
            pool.append((off.stats.host_pool_bytes, off.stats.host_pool_reserved_bytes))
    assert max(allocated) == min(allocated)
    assert len(set(pool)) == 1 and pool[0][0] == 0


def test_timing_measures_copies_at_link_speed() -> None:
    layers = llama(n=4, dim=1024, heads=8, ffn=2816)
    off = offload.ActivationOffloader(layers, offload_layers="all", timing=True)
    x = torch.randn(2, 2048, 1024, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        run(layers, x, off)
    for la in off.stats.layers:
        if not la.offloaded:
            assert la.d2h_seconds == la.h2d_seconds == 0.0
            continue
        d2h = la.bytes_offloaded / la.d2h_seconds / 1e9
        h2d = la.bytes_offloaded / la.h2d_seconds / 1e9
        # pinned copies on a PCIe or NVLink-C2C host link: between 5 and 1000 GB/s
        assert 5 < d2h < 1000 and 5 < h2d < 1000, (la.index, d2h, h2d)
        assert la.stall_seconds >= 0.0
    print(
        "timing (GB/s):",
        [
            round(la.bytes_offloaded / la.d2h_seconds / 1e9, 1)
            for la in off.stats.layers
            if la.offloaded
        ],
    )


def test_cpu_scalar_saved_first_does_not_pin_the_offloader_to_the_cpu() -> None:
    """A layer whose first saved tensor is a CPU scalar (``x * torch.tensor(2.0)`` saves
    the scalar; SDPA's dispatch returns CPU tensors beside its CUDA outputs) still
    offloads its CUDA activations: the CPU binding gives way while nothing was copied."""

    class ScalarFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x * torch.tensor(2.0)))

    torch.manual_seed(0)
    layers = nn.ModuleList(ScalarFirst() for _ in range(3)).to(DEV)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(64, 256, device=DEV)
    assert_same(run(layers, x, off), run(ref, x))
    stats = off.stats
    assert stats.bytes_kept["device"] == 0
    assert [la.bytes_offloaded > 0 for la in stats.layers] == [True, True, False]
    off.close()
