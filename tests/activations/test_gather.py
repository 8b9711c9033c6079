"""Gathered copies (offload/activations/_saves.py, Note [release order], 1(b)): the small
contiguous tensors of one layer call and dtype travel in one bucket, one copy each way.
Every test compares against the model without offloading with ``torch.equal`` and
checks that the bucket path was taken."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload._core import _runtime, _transfer
from offload.activations import _saves
from offload.activations._control import Internals
from offload.activations._handles import Gathered, Pending
from offload.activations._saves import _Bucket
from tests import models


class ManySmall(nn.Module):
    """Saves ``n`` small fp32 tensors (each ``sin``'s input) and one bf16 one."""

    def __init__(self, n: int, dim: int = 64) -> None:
        super().__init__()
        self.n = n
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        for _ in range(self.n):
            h = torch.sin(h)
        return h + torch.sin(h.bfloat16()).float()


def _wrap_backends(monkeypatch: pytest.MonkeyPatch, wrap) -> None:
    """``wrap(backend)`` applied to every copy backend an offloader makes meanwhile (its
    runtime makes one per device at first use, through ``_runtime.backend_for``)."""
    make = _runtime.backend_for

    def backend_for(device, stream=None):
        backend = make(device, stream)
        wrap(backend)
        return backend

    monkeypatch.setattr(_runtime, "backend_for", backend_for)


class _CountingD2H:
    """Counts the D2H copies the offloaders made meanwhile issue (their CPU backends,
    wrapped)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pairs = 0
        _wrap_backends(monkeypatch, self._wrap)

    def _wrap(self, backend) -> None:
        original = backend.d2h

        def d2h(pairs, fence, times=None, transient=None, ready=None):
            self.pairs += len(pairs)
            return original(pairs, fence, times, transient, ready)

        backend.d2h = d2h  # type: ignore[method-assign]


def _buckets(off: offload.ActivationOffloader) -> list:
    """The buckets of the offloader's last step, call after call."""
    return [b for la in off.last_step.layers for b in la.buckets]


def test_small_tensors_share_one_copy_per_layer_and_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(ManySmall(12) for _ in range(3))
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
    counter = _CountingD2H(monkeypatch)
    x = torch.randn(4, 64)
    got = models.step(layers, x, models.run_plain, off)
    models.assert_same(got, models.step(ref, x, models.run_plain))
    stats = off.stats
    assert stats.bytes_offloaded > 0
    # two offloaded layers, each: one fp32 bucket (fc's input, 12 sin inputs, the add's
    # input) and one bf16 bucket (the last sin's input): four copies, not 30
    assert counter.pairs == 4
    step = off.last_step
    buckets = _buckets(off)
    assert len(buckets) == 4
    assert {b.dtype for b in buckets} == {torch.float32, torch.bfloat16}
    assert stats.bytes_offloaded == sum(b.nbytes for b in buckets)
    assert stats.bytes_by_dtype["bfloat16"] == 2 * 4 * 64 * 2
    assert stats.host_pool_bytes == 0  # every block returned after the backward
    assert step.awaiting_backward == 0 and step.backward_done


def test_bucket_grows_in_place_and_seals_at_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_saves, "_GATHER_FIRST_BYTES", 4096)
    monkeypatch.setattr(_saves, "_GATHER_BUCKET_BYTES", 16384)
    torch.manual_seed(0)
    layers = nn.ModuleList(ManySmall(40) for _ in range(2))  # 40 x 1 KiB per layer
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    x = torch.randn(4, 64)
    got = models.step(layers, x, models.run_plain, off)
    models.assert_same(got, models.step(ref, x, models.run_plain))
    fp32 = [b for b in _buckets(off) if b.dtype is torch.float32]
    # 41 fp32 tensors of 1 KiB (fc's input, 40 sin inputs) in buckets of at most 16 KiB,
    # each grown in place from 4 KiB
    assert [b.nbytes for b in fp32] == [16384, 16384, 9 * 1024]
    assert off.stats.host_pool_bytes == 0


def test_host_budget_below_a_bucket_falls_back_to_a_copy_each() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(ManySmall(4) for _ in range(2))
    ref = models.twin(layers)
    # room for single 1 KiB tensors, not for a 256 KiB bucket reservation
    off = offload.ActivationOffloader(
        layers, offload_layers=1, min_tensor_bytes=0, host_memory_limit=64 << 10
    )
    x = torch.randn(4, 64)
    got = models.step(layers, x, models.run_plain, off)
    models.assert_same(got, models.step(ref, x, models.run_plain))
    # fc's input, 4 sin inputs (fp32) and one bf16 tensor, each with its own block
    assert off.stats.bytes_offloaded == 5 * 1024 + 512
    assert off.stats.bytes_kept["host_limit"] == 0
    assert not _buckets(off)


class SavesTwice(nn.Module):
    """Saves ``h`` twice (``h * h``) and a view of it (``v``, another shape, at an
    offset into ``h``'s storage)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        v = h.view(-1, 16)[1:]
        return (h * h).sum(-1, keepdim=True) + torch.sin(v).sum() + h


def test_saving_a_member_again_reuses_its_place() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(SavesTwice() for _ in range(2))
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    handles: list[object] = []
    original = off._pack

    def spy(t: torch.Tensor) -> object:
        handle = original(t)
        handles.append(handle)
        return handle

    off._pack = spy  # type: ignore[method-assign]
    x = torch.randn(4, 64)
    got = models.step(layers, x, models.run_plain, off)
    models.assert_same(got, models.step(ref, x, models.run_plain))
    # the first layer's handles are placed at its close (Note [release order], 1(c))
    placed = [h.inner if type(h) is Pending else h for h in handles]
    gathered = [h for h in placed if type(h) is Gathered]
    assert len(gathered) == 4  # x, h, h again, v
    assert len({h.index for h in gathered}) == 2  # ... of two members
    assert sorted(h.offset for h in gathered) == [0, 256, 256, 256 + 16]
    # h's bytes travelled once: the bucket holds x and h
    (bucket,) = _buckets(off)
    assert bucket.tensors == 2


def test_unpacking_twice_gets_equal_fresh_tensors() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(ManySmall(3) for _ in range(2))
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    x = torch.randn(4, 64)
    # two backwards over one graph: the second unpack of each handle is a fresh view
    got = models.step(layers, x, models.run_plain, off, backwards=2)
    models.assert_same(got, models.step(ref, x, models.run_plain, backwards=2))
    assert off.stats.bytes_offloaded > 0


def test_inplace_change_poisons_that_member_only() -> None:
    class Modifies(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.fc(x)
            c = a * 2
            out = torch.sin(a) + torch.sin(c)  # saves a and c
            c.add_(1)  # changes a saved tensor
            return out

    torch.manual_seed(0)
    layers = nn.ModuleList([Modifies(), nn.Linear(64, 64)])
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    x = torch.randn(4, 64, requires_grad=True)
    with off:
        y = layers[1](layers[0](x))
    # the release (at layer 1) found the change: only c's place is poisoned
    (bucket,) = _buckets(off)
    assert bucket.tensors == 3 and list(bucket.poisoned) == [2]
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_exception_in_a_layer_returns_an_open_bucket() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.sin(x)
            raise ValueError("boom")

    layers = nn.ModuleList([ManySmall(3), Fails()])
    off = offload.ActivationOffloader(layers, offload_layers=[0, 1], min_tensor_bytes=0)
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(ValueError, match="boom"), off:
        models.run_plain(layers, x)
    assert off.stats.host_pool_bytes == 0
    step = off.last_step
    assert step.aborted and all(not b.on_host for b in _buckets(off))


def test_bucket_is_a_copy_for_the_rest_of_the_scheduler() -> None:
    assert issubclass(_Bucket, _transfer.HostCopy)


def test_no_buckets_under_compression_or_manual_synchronization() -> None:
    """Compressed copies quantize tensor by tensor, and in manual mode the caller
    issues each layer's copies: neither gathers."""
    torch.manual_seed(0)
    layers = nn.ModuleList(ManySmall(3) for _ in range(2))
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0, compress="fp8")
    models.step(layers, torch.randn(4, 64), models.run_plain, off)
    # the bf16 tensor was quantized; the fp32 ones travelled exactly, one copy each
    assert off.stats.compress_bytes_after > 0 and not _buckets(off)

    layers = nn.ModuleList(ManySmall(3) for _ in range(2))
    ref = models.twin(layers)
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=2, manual_synchronization=True
    )
    x = torch.randn(4, 1024, 64)  # 1 MiB tensors: above the context's default minimum
    got = models.step(layers, x, lambda ls, h: _run_manual(ls, h, ctx, sync, sched))
    models.assert_same(got, models.step(ref, x, models.run_plain))
    assert sched.stats().bytes_offloaded > 0
    assert not ctx.step.all_buckets


def _run_manual(layers, h, ctx, sync, sched):
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        sched.start_offload_layer(i)
    for i in range(len(layers)):
        sched.release_activation_forward_gpu_memory(i)
    return h


def test_a_reloaded_bucket_is_never_seen_waited_for_before_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gathered.unpack reads ``bucket.buffer`` and ``bucket.waited`` without the lock:
    when a bucket is reloaded again (a second backward over a retained graph, after
    its first backward dropped the buffer), its new buffer must not appear with the
    ``waited`` of the previous reload (Note [release order], 5)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(ManySmall(3) for _ in range(3))
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
    seen: list[bool] = []

    def wrap(backend) -> None:
        original = backend.h2d

        def h2d(pairs, waits, stream, times=None):
            # the buckets' device buffers, by identity, in the middle of their reload:
            # the step's own objects (a view is a snapshot, taken under the lock)
            buckets = Internals(off).last_step().all_buckets
            for _src, dst, _codec in pairs:
                for b in buckets:
                    if b.buffer is dst:
                        seen.append(b.waited)
            return original(pairs, waits, stream, times)

        backend.h2d = h2d  # type: ignore[method-assign]

    _wrap_backends(monkeypatch, wrap)
    x = torch.randn(4, 64)
    got = models.step(layers, x, models.run_plain, off, backwards=2)
    models.assert_same(got, models.step(ref, x, models.run_plain, backwards=2))
    # two backwards, two offloaded layers with an fp32 and a bf16 bucket each
    assert len(seen) == 8 and not any(seen)
