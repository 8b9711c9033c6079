"""Measuring on the device: the pinned link probe and the timed-step loop.

One probe of the host link and one loop of timed steps, shared by ``offload_layers="auto"``,
the planner and :func:`offload.profile_step`, so that the three report the same figures.
Importing this module touches no CUDA state; each function does only when called.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "LINK_PROBE_BYTES",
    "StepTimes",
    "host_copy_bandwidth",
    "link_bandwidth",
    "settle",
    "timed_steps",
]

#: Bytes of each pinned <-> device copy of the link probe.
LINK_PROBE_BYTES = 256 << 20

#: Timed copies each way of the link probe (after one warm-up copy); the median counts.
LINK_REPEATS = 3

_BANDWIDTH: dict[tuple[torch.device, int], tuple[float, float]] = {}


def link_bandwidth(device: torch.device, nbytes: int = LINK_PROBE_BYTES) -> tuple[float, float]:
    """Pinned host <-> ``device`` bytes per second ``(D2H, H2D)``.

    Measured once per device and size: on a side stream (as the offloader's copies run),
    one warm-up copy each way, then :data:`LINK_REPEATS` timed copies each way (CUDA
    events); the median of each direction counts. One host synchronisation.

    Args:
        device: a CUDA device.
        nbytes: bytes of each copy. Default :data:`LINK_PROBE_BYTES` (256 MiB).
    """
    key = (device, nbytes)
    cached = _BANDWIDTH.get(key)
    if cached is not None:
        return cached
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    events: dict[str, list[tuple[Any, Any]]] = {"d2h": [], "h2d": []}
    with torch.cuda.stream(stream):
        for kind, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            dst.copy_(src, non_blocking=True)  # warm-up
            for _ in range(LINK_REPEATS):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                events[kind].append((start, end))
    stream.synchronize()
    rates = []
    for kind in ("d2h", "h2d"):
        ms = statistics.median(s.elapsed_time(e) for s, e in events[kind])
        rates.append(nbytes / (ms / 1e3))
    del host, dev
    _BANDWIDTH[key] = (rates[0], rates[1])
    return rates[0], rates[1]


def host_copy_bandwidth(nbytes: int = LINK_PROBE_BYTES // 4) -> tuple[float, float]:
    """Bytes per second of a copy between two host buffers, as ``(D2H, H2D)`` (equal):
    the "link" of the CPU path, where an offloaded tensor's copy is a host memcpy.
    Measured once per size: one warm-up copy, then the median of :data:`LINK_REPEATS`.

    Args:
        nbytes: bytes of each copy. Default 64 MiB.
    """
    key = (torch.device("cpu"), nbytes)
    cached = _BANDWIDTH.get(key)
    if cached is not None:
        return cached
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (pages touched)
    times = []
    for _ in range(LINK_REPEATS):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    rate = nbytes / max(statistics.median(times), 1e-9)
    _BANDWIDTH[key] = (rate, rate)
    return rate, rate


def settle(device: torch.device | None) -> None:
    """Start a measurement from a known state: garbage collected and, on CUDA, the
    device idle and the caching allocator's unused blocks released (blocks cached by
    whatever ran before, of other sizes, make the next steps' times scatter)."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@dataclasses.dataclass
class StepTimes:
    """What :func:`timed_steps` measured over the timed steps.

    Attributes:
        seconds: each timed step's seconds (CUDA events on the current stream; the host
            clock without CUDA).
        peak_allocated: the largest ``max_memory_allocated`` over the timed steps (CUDA;
            else ``None``).
        peak_reserved: the largest ``max_memory_reserved`` (CUDA; else ``None``).
        activation: the largest activation peak: memory allocated at a step's peak above
            what was allocated before it (weights, gradients) (CUDA; else ``None``).
        host: each timed step's host seconds, from the call of ``step_fn`` to its
            return (before any synchronisation: close to :attr:`seconds` where the
            host paces the step).
    """

    seconds: list[float]
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    activation: int | None = None
    host: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        """The median of :attr:`seconds`."""
        return float(statistics.median(self.seconds))


def timed_steps(
    step_fn: Callable[[], Any],
    steps: int,
    warmup: int,
    *,
    device: torch.device | None = None,
    before_step: Callable[[], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> StepTimes:
    """Run ``warmup + steps`` steps from a settled state (:func:`settle`) and measure
    the last ``steps``.

    On CUDA each step is preceded by a device synchronisation, the allocated bytes read
    and the peak statistics reset, and timed with CUDA events on the current stream;
    elsewhere with the host clock.

    Args:
        step_fn: ``callable()``, one step.
        steps: timed steps (>= 1).
        warmup: unmeasured steps before them (>= 0).
        device: where the step runs. Default ``None``: the current CUDA device when CUDA
            is available, else the CPU.
        before_step: called before every step, outside the timed span (``None``: nothing).
        after_step: called after every step, outside the timed span (``None``: nothing).
    """
    if device is None:
        cuda_here = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda_here else None
        device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    settle(device)
    out = StepTimes(seconds=[])
    peaks: list[tuple[int, int, int]] = []
    for i in range(warmup + steps):
        if before_step is not None:
            before_step()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step_fn()
            host = time.perf_counter() - t0
            end.record()
            torch.cuda.synchronize(device)
            seconds = start.elapsed_time(end) / 1e3
            peak = torch.cuda.max_memory_allocated(device)
            if i >= warmup:
                peaks.append((peak, torch.cuda.max_memory_reserved(device), peak - before))
        else:
            t0 = time.perf_counter()
            step_fn()
            seconds = host = time.perf_counter() - t0
        if i >= warmup:
            out.seconds.append(seconds)
            out.host.append(host)
        if after_step is not None:
            after_step()
    if peaks:
        out.peak_allocated = max(p[0] for p in peaks)
        out.peak_reserved = max(p[1] for p in peaks)
        out.activation = max(p[2] for p in peaks)
    return out
