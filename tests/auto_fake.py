"""A device for ``offload_layers="auto"`` on the CPU: layer timings, step times and
device memory injected through the policy's meter (``offload/activations/_auto/_probe.py``).

The policy runs unchanged; only what it reads from the clock and the allocator comes
from here. Per step the meter knows the policy's record (``begin``): its size
(``tokens``), how many leading layers it offloads and whether it measures. Marks carry
a simulated timestamp on that step's device timeline (forward of each call, the gap,
backward of each call in reverse), so every duration the policy derives is the
injected one; a step's total time comes from :attr:`FakeMeter.step_time`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from offload.activations._auto._predict import LayerCost, predict_step
from offload.activations._auto._probe import DeviceMemory, Meter
from offload.activations._auto._settings import AutoSettings

#: the settings an offloader's "auto" policy uses (its defaults)
AUTO = AutoSettings()


@pytest.fixture
def one_thread():
    """Small CPU models run faster on one thread (and do not crowd a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def state_bounds() -> dict[str, int]:
    """The most :meth:`offload.activations._auto._policy.AutoPolicy.state_size` may report."""
    return {
        "families": AUTO.max_families,
        "points": AUTO.max_points,
        "decisions": AUTO.max_decisions,
        "pending": AUTO.max_pending,
        "samples": AUTO.verify_steps + AUTO.watch_steps,
    }


@dataclasses.dataclass
class FakeMemory:
    """Device memory: a fixed ``base`` allocated before each step, ``act(tokens)``
    bytes at the peak with ``"all"``, and ``freed(tokens)[i]`` more while call ``i``
    stays resident. Every step's simulated peak is kept in :attr:`peaks`; the
    allocator's peak counter is reset when a step starts (after the policy's reading
    before its first layer), as a loop that resets it every step does."""

    limit: int
    base: int
    act: Callable[[int], float]
    freed: Callable[[int], list[int]]
    peaks: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
    counter: float = 0.0  # the allocator's peak since its last reset
    #: what the allocator reserves beyond the allocated peak at that peak (the unused
    #: parts of its segments); the limit applies to the allocated peak plus this
    slack: int = 0
    reserved: float = 0.0  # the allocator's reserved peak since its last reset

    def peak(self, tokens: int, k: int, recomputed: tuple[int, ...] = ()) -> float:
        """The peak offloading the first ``k`` calls, ``recomputed`` ones recomputed
        (their saves off the device like an offloaded call's)."""
        freed = self.freed(tokens)
        kept = [i for i in range(k, len(freed) - 1) if i not in recomputed]
        return self.base + self.act(tokens) + sum(freed[i] for i in kept)


@dataclasses.dataclass(frozen=True)
class _Mark:
    """A mark of :class:`FakeMeter`: its simulated time and the step it belongs to."""

    t: float
    step: int


class FakeMeter(Meter):
    """Injected timings (module docstring).

    Args:
        costs: ``costs(tokens) -> [LayerCost]``: the true costs of one step.
        link: bytes per second each way.
        gap: ``gap(tokens)``: seconds between the last forward and its backward.
        step_time: ``step_time(tokens, k) -> seconds`` of a real step offloading the
            first ``k`` calls; default: :func:`predict_step` of the true costs.
        probe_factor: what a measuring forward's instrumentation multiplies every
            measured layer time by.
        memory: a :class:`FakeMemory`, or ``None`` (no gauge).
        first_call: seconds a measuring forward's first call takes beyond its cost
            (kernel selection for a shape not seen before).
        cold_factor: what the offloader's first step multiplies every measured time by
            (the allocator, the host pool and the kernels warming up).
        cold_first_call: seconds the offloader's first step adds to its first call
            (the one-time costs of a cold step do not fall evenly on its calls).
        lag: steps a step's marks stay incomplete after it began unless a wait
            completes them (the host running ahead of the device: a CUDA event is
            complete only once the device got there). Default 0: complete at once.
    """

    def __init__(
        self,
        costs: Callable[[int], list[LayerCost]],
        link: float,
        *,
        gap: Callable[[int], float] = lambda n: 0.0,
        step_time: Callable[[int, int], float] | None = None,
        probe_factor: float = 1.0,
        memory: FakeMemory | None = None,
        first_call: float = 0.0,
        cold_factor: float = 1.0,
        cold_first_call: float = 0.0,
        lag: int = 0,
    ) -> None:
        self.costs = costs
        self.bps = link
        self.gap = gap
        self.step_time = step_time or (
            lambda n, k: predict_step(costs(n), range(k), link, link, None, gap(n))
        )
        self.probe_factor = probe_factor
        self.first_call = first_call
        self.cold_factor = cold_factor
        self.cold_first_call = cold_first_call
        self.lag = lag
        self.begun = 0  # steps begun
        self.done = 0  # steps whose marks a wait completed
        self.fake_memory = memory
        self.records: list[Any] = []
        self._times: dict[tuple[str, int], float] = {}
        if memory is not None:
            memory.counter = memory.reserved = memory.base

    def begin(self, record: Any) -> None:
        self.records.append(record)
        self.begun += 1
        n, k = record.tokens, record.offloaded
        costs = self.costs(n)
        probe = record.run.value == "probe"
        f = self.probe_factor if probe else 1.0
        if record.cold:
            f *= self.cold_factor
        times: dict[tuple[str, int], float] = {("start", 0): 0.0}
        t = 0.0
        for i, c in enumerate(costs):
            times[("f0", i)] = t
            t += c.forward_s * f + (self.first_call if probe and i == 0 else 0.0)
            t += self.cold_first_call if record.cold and i == 0 else 0.0
            times[("f1", i)] = t
        t += self.gap(n) * f
        for i in range(len(costs) - 1, -1, -1):
            times[("b0", i)] = t
            t += costs[i].backward_s * f
            times[("b1", i)] = t
        times[("end", 0)] = t if probe else self.step_time(n, k)
        self._times = times
        self._tokens, self._k, self._recomputed = n, k, record.recomputed
        if self.fake_memory is not None:
            self.fake_memory.counter = self.fake_memory.reserved = self.fake_memory.base

    def mark(self, device: Any, what: str, index: int) -> tuple[Any, float]:
        mem = self.fake_memory
        if what == "end" and mem is not None:
            peak = mem.peak(self._tokens, self._k, self._recomputed)
            mem.peaks.append((self._tokens, self._k, peak))
            mem.counter = max(mem.counter, peak)
            mem.reserved = max(mem.reserved, peak + mem.slack)
        return _Mark(self._times[(what, index)], self.begun), 0.0

    def seconds(self, a: Any, b: Any) -> float | None:
        if b.step > self.done and self.begun - b.step < self.lag:
            return None  # the device has not got there yet
        return b.t - a.t

    def wait(self, a: Any) -> None:
        self.done = max(self.done, a.step)

    def memory(self, device: Any) -> DeviceMemory | None:
        mem = self.fake_memory
        if mem is None:
            return None
        return DeviceMemory(mem.limit, mem.base, int(mem.counter), int(mem.reserved))

    def allocated(self, device: Any) -> int | None:
        return None if self.fake_memory is None else self.fake_memory.base

    def link(self, device: Any) -> tuple[float, float]:
        return self.bps, self.bps
