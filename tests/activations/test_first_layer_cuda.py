"""The step's first layer call on a CUDA GPU (Note [release order], 1(c)): its saves are
placed at its close, yet each large copy waits for exactly its producer, neither less
(the bytes copied are the ones produced) nor more (the copy starts before the layer's
later kernels end). Run with
``PYTHONPATH=. python3 -m pytest -m cuda tests/activations/test_first_layer_cuda.py``."""

from __future__ import annotations

import torch
from torch import nn

import offload
from offload.activations._control import Internals
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same, twin

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"
#: GPU clock cycles of torch.cuda._sleep: about 50 ms on an H200 (1.98 GHz)
LONG = 100_000_000


class SlowProducer(nn.Module):
    """Produces a 64 MiB tensor late (a long kernel first), saves it, then runs another
    long kernel: a copy ordered before the producer reads stale bytes, a copy ordered
    after the whole layer starts only after the second sleep."""

    def __init__(self, dim: int = 256, before: int = 0, after: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.before, self.after = before, after
        #: events recorded around the second sleep
        self.marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.before:
            torch.cuda._sleep(self.before)
        big = x.repeat(1, 256, 1)  # 64 MiB in fp32 for x of 1 x 256 x 256
        y = torch.sin(big).mean(1, keepdim=True)  # saves big
        if self.after:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(self.after)
            b.record()
            self.marks = (a, b)
        return self.fc(x + y)


def test_first_layer_copy_waits_for_its_producer() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(SlowProducer(before=LONG if i == 0 else 0) for i in range(4)).to(DEV)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=3, min_tensor_bytes=0)
    for it in range(3):  # the allocator hands `big` the block of the last step's `big`
        x = torch.randn(1, 256, 256, device=DEV) + it
        got = models.step(layers, x, models.run_plain, off)
        assert_same(got, models.step(ref, x, models.run_plain))
        assert off.stats.layers[0].bytes_offloaded >= 64 << 20


def test_first_layer_copy_starts_before_the_layer_ends() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(SlowProducer(after=LONG if i == 0 else 0) for i in range(3)).to(DEV)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0, timing=True)
    x = torch.randn(1, 256, 256, device=DEV)
    for _ in range(2):
        got = models.step(layers, x, models.run_plain, off)
        assert_same(got, models.step(ref, x, models.run_plain))
    torch.cuda.synchronize()
    # the first call's copy records (kind, start event, end event): the profiler's
    # accessor, as the events cannot be part of a snapshot
    records = Internals(off).copy_records()
    starts = [rec[1] for index, rec in records if index == 0 and rec[0] == "d2h"]
    assert starts and off.stats.layers[0].bytes_offloaded >= 64 << 20
    a, b = layers[0].marks
    sleep_ms = a.elapsed_time(b)
    first_copy_ms = a.elapsed_time(starts[0])
    # the 64 MiB copy started while the long kernel queued after its save ran: its
    # mark was taken at the save, not at the layer's close (after the kernel)
    assert sleep_ms > 5.0 and first_copy_ms < sleep_ms / 2, (first_copy_ms, sleep_ms)


def test_first_layer_placed_once_the_host_is_a_call_ahead() -> None:
    # Note [release order], 1(c): with the next call not offloaded, the first call's
    # saves wait past its close until the host is a call ahead of the device. Layer 1
    # starts with a long kernel after the mark taken at its open: at the open of call 2
    # the device has passed that mark (a new one is taken), at the open of call 3 it is
    # still in the long kernel, short of call 2's mark: call 3 places them.
    torch.manual_seed(0)
    layers = nn.ModuleList(SlowProducer(before=LONG if i == 1 else 0) for i in range(6)).to(DEV)
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    for it in range(2):
        x = torch.randn(1, 256, 256, device=DEV) + it
        torch.cuda.synchronize()  # as a model that checks its mask on the host does
        got = models.step(layers, x, models.run_plain, off)
        assert_same(got, models.step(ref, x, models.run_plain))
        step = off.last_step
        assert step.placed_late_at == 3, step.placed_late_at
        assert off.stats.layers[0].bytes_offloaded >= 64 << 20
        assert off.stats.layers[0].bytes_released >= 64 << 20
    off.close()


def test_first_layer_placed_at_its_close_when_the_next_call_is_offloaded() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(SlowProducer() for _ in range(4)).to(DEV)
    off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
    models.step(layers, torch.randn(1, 256, 256, device=DEV), models.run_plain, off)
    assert off.last_step.placed_late_at is None
    assert off.stats.layers[0].bytes_offloaded >= 64 << 20
    off.close()
