"""How ``offload_layers="auto"`` measures: a clock and memory gauge (:class:`Meter`),
the light timer every decided step carries (:class:`StepWatch`) and the measuring
forward (:class:`Probe`).

A step talks to these through three calls (``Step.watch``): ``opened(step, group,
inputs)`` when a layer call starts, ``closed(step, group, outputs)`` when it ends, and
``count(index, key, nbytes)`` for a tensor a measuring forward saves in a call that is
not offloaded (the bytes offloading it would send; only a first measurement counts,
``Probe.counts``: later ones take the bytes from the prediction, and those calls run
without the saved-tensor hooks). Nothing else of the step is read while it runs.

The measuring forward runs the plan it is given (``"all"`` the first time: it never
needs more device memory than ``"all"``) and times each layer call on the compute
stream with the copies in flight. A layer's forward is timed from its start to its end
(the compute stream waits for a release before the call's start mark, so a forward
stall falls between calls, not in one); its backward from its first output gradient to
its last input gradient, less the time the compute stream stood still waiting for that
call's reload (the stall records of ``timing``). The device time between the last
call's forward end and its backward start (head, loss) is the ``gap``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch

from offload._core import _measure, _packing
from offload.activations._auto import _predict as _auto
from offload.activations._auto._settings import DEFAULT_AUTO

__all__ = ["DeviceMemory", "ProbeResult", "Meter", "Probe", "StepWatch", "meter_for"]


_tensors_in = _packing.tensors_requiring_grad


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Device memory as the allocator sees it, in bytes: ``limit`` (what this
    process's tensors may occupy in all: the per-process fraction's cap or what is
    reserved plus what is free, the smaller), ``allocated`` now, ``peak`` (the
    allocator's peak since its last reset) and ``reserved_peak`` (the peak of what it
    reserved, tensors and the unused parts of its segments; ``None``: not known). The
    cap limits what is reserved, not what is allocated."""

    limit: int
    allocated: int
    peak: int
    reserved_peak: int | None = None


class Meter:
    """The host clock and no memory gauge: the CPU path (``Internals.use_meter(Meter())``).

    Marks are ``(device mark, host seconds)``; here the device mark is the host clock
    too. Subclasses: :class:`CudaMeter`; tests inject their own to give timings and
    memory of their choosing."""

    def begin(self, record: Any) -> None:
        """A step described by ``record`` (``offload/activations/_auto/_policy.py``) starts."""

    def mark(self, device: torch.device | None, what: str, index: int) -> tuple[Any, float]:
        """A time mark on the current stream; ``what`` and ``index`` name it (``"f0"``,
        ``"f1"``, ``"b0"``, ``"b1"`` of call ``index``; ``"start"`` and ``"end"`` of
        the step)."""
        now = time.perf_counter()
        return now, now

    def seconds(self, a: Any, b: Any) -> float | None:
        """Device seconds from mark ``a`` to mark ``b`` (their first items); ``None``
        while ``b`` has not completed."""
        return b - a

    def wait(self, a: Any) -> None:
        """Block until the device mark ``a`` has completed."""

    def stall_seconds(self, records: list[tuple[Any, ...]]) -> float:
        """Seconds the compute stream waited, summed over ``("stall", ...)`` records of
        ``timing`` (``(kind, seconds)`` on the host or ``(kind, before, after)``)."""
        return sum(r[1] for r in records if r[0] == "stall" and len(r) == 2)

    def memory(self, device: torch.device | None) -> DeviceMemory | None:
        """The device memory now; ``None`` where there is none to save."""
        return None

    def allocated(self, device: torch.device | None) -> int | None:
        """Bytes allocated now (cheaper than :meth:`memory`); ``None`` as there."""
        return None

    def link(self, device: torch.device | None) -> tuple[float, float]:
        """Host link bytes per second (D2H, H2D); without an accelerator, a host
        memcpy's (the CPU path's copies)."""
        if device is None or device.type != "cuda":
            return _measure.host_copy_bandwidth()
        return _auto.link_bandwidth(device)


class CudaMeter(Meter):
    """CUDA events on the current stream and the caching allocator's statistics."""

    def mark(self, device: torch.device | None, what: str, index: int) -> tuple[Any, float]:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event, time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float | None:
        if not b.query():
            return None
        return a.elapsed_time(b) / 1e3

    def wait(self, a: Any) -> None:
        a.synchronize()

    def stall_seconds(self, records: list[tuple[Any, ...]]) -> float:
        total = 0.0
        for r in records:
            if r[0] != "stall":
                continue
            if len(r) == 2:
                total += r[1]
            else:
                r[2].synchronize()
                total += r[1].elapsed_time(r[2]) / 1e3
        return total

    def memory(self, device: torch.device | None) -> DeviceMemory | None:
        if device is None or device.index is None:  # some torch versions need the index
            device = torch.device("cuda", torch.cuda.current_device())
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        try:
            allocated = stats["allocated_bytes"]["all"]
            current, peak = allocated["current"], allocated["peak"]
            reserved = stats["reserved_bytes"]["all"]["current"]
            reserved_peak = stats["reserved_bytes"]["all"]["peak"]
        except KeyError:  # an allocator backend without these statistics: no gauge
            return None
        free, total = torch.cuda.mem_get_info(device)
        try:
            fraction = torch.cuda.get_per_process_memory_fraction(device)
        except (AttributeError, RuntimeError):  # older PyTorch: no getter
            fraction = 1.0
        limit = min(int(total * fraction), reserved + free)
        return DeviceMemory(limit, current, peak, reserved_peak)

    def allocated(self, device: torch.device | None) -> int | None:
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        return stats.get("allocated_bytes", {}).get("all", {}).get("current")


def meter_for(device: torch.device) -> Meter | None:
    """The meter for tensors on ``device``: CUDA's, or ``None`` (nothing to measure)."""
    return CudaMeter() if device.type == "cuda" else None


class StepWatch:
    """Times one step on the compute stream, from the start of its first layer call to
    the end of its backward (two marks, one gradient hook on the first call's outputs
    and one engine callback), and reads the device memory at the end (``memory``).

    ``record``: the policy's description of the step (kept for it, never read here)."""

    def __init__(
        self, meter: Meter, device: torch.device | None, record: Any, memory: bool = True
    ) -> None:
        self.meter = meter
        self.device = device
        self.record = record
        self.read_memory = memory
        self.start: tuple[Any, float] | None = None
        self.end: tuple[Any, float] | None = None
        self.end_memory: DeviceMemory | None = None
        self._queued = False
        self._hooks: list[Any] = []

    # ---- the step's calls --------------------------------------------------------------

    def opened(self, step: Any, group: Any, inputs: Any) -> None:
        if group.index == 0:
            self.start = self.meter.mark(self.device, "start", 0)

    def closed(self, step: Any, group: Any, outputs: Any) -> None:
        if group.index == 0:
            tensors = _tensors_in(outputs, [])
            if len(tensors) == 1:  # the usual case: a plain hook is cheaper
                self._hooks.append(tensors[0].register_hook(self._backward_reached))
            elif tensors:
                self._hooks.append(
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, self._backward_reached, mode="any"
                    )
                )

    def count(self, index: int, key: int, nbytes: int) -> None:
        """A measuring forward's candidate bytes (only :class:`Probe` keeps them)."""

    # ---- the backward ------------------------------------------------------------------

    def _backward_reached(self, _grad: Any) -> None:
        """The first call's backward starts: the step's backward ends with the graph
        task, where the engine runs queued callbacks."""
        if self._queued:
            return
        self._queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        except RuntimeError:  # not inside a backward (cannot happen from a grad hook)
            self._backward_ended()

    def _backward_ended(self) -> None:
        self.end = self.meter.mark(self.device, "end", 0)
        if self.read_memory:
            self.end_memory = self.meter.memory(self.device)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def seconds(self) -> float | None:
        """The step's device seconds; ``None`` until its backward ended and completed."""
        if self.start is None or self.end is None:
            return None
        return self.meter.seconds(self.start[0], self.end[0])


@dataclasses.dataclass
class ProbeResult:
    """What one measuring forward measured, per layer call: device seconds of forward
    and backward, host seconds issuing them (less the offloader's own per-copy work in
    calls that were offloaded), the bytes offloading sends (``link_bytes``) and frees
    on the device (``freed_bytes``), the number of copies; then the ``gap`` and the
    most bytes allocated at the marks (``allocated_max``, ``None`` without a gauge)."""

    forward_s: list[float]
    backward_s: list[float]
    host_forward_s: list[float]
    host_backward_s: list[float]
    link_bytes: list[int]
    freed_bytes: list[int]
    copies: list[int]
    offloaded: list[bool]
    gap_s: float
    allocated_max: int | None


class Probe(StepWatch):
    """The measuring forward: :class:`StepWatch` plus four marks per layer call, the
    bytes each call saves (``counts``) and the compute stream's stalls (module
    docstring)."""

    def __init__(
        self,
        meter: Meter,
        device: torch.device | None,
        record: Any,
        memory: bool = True,
        counts: bool = True,
        per_copy: float = DEFAULT_AUTO.host_seconds_per_copy,
    ) -> None:
        super().__init__(meter, device, record, memory)
        #: host seconds offloading adds per copy, modelled apart (LayerCost.forward)
        self.per_copy = per_copy
        #: whether the calls not offloaded count the bytes they would send (else the
        #: policy predicts them: ``link_bytes`` and ``freed_bytes`` are 0 there)
        self.counts = counts
        self.marks: list[dict[str, Any]] = []
        #: per call: storage -> bytes it would send (saves placed in a call before its
        #: start mark, a checkpoint's inputs, count too)
        self.candidates: dict[int, dict[int, int]] = {}
        self.owner: dict[int, int] = {}  # storage -> the call that saved it first
        self.stats: list[Any] = []  # each call's LayerStats
        self.copies: list[int] = []
        self.offloaded: list[bool] = []
        #: each call's timing records (the compute stream's stalls among them), and how
        #: many there were at the last call's end and at the backward's start
        self.times: list[list[Any]] = []
        self.at_close: list[int] = []
        self.at_backward: list[int] | None = None
        self.allocated_max: int | None = None
        #: per call: whether it ran recomputed (Note [recomputed calls]) and its module's
        #: class, whose measured calls stand in for it (:meth:`_stand_in`)
        self.recomputed: list[bool] = []
        self.kinds: list[type] = []

    def opened(self, step: Any, group: Any, inputs: Any) -> None:
        super().opened(step, group, inputs)
        if group.times is None:
            group.times = []  # stall records (Backend.wait)
        self.times.append(group.times)
        self.stats.append(group.stats)
        self.offloaded.append(bool(group.offload))
        self.recomputed.append(bool(group.stats.recomputed))
        self.kinds.append(type(group.module))
        self.copies.append(0)
        index = group.index
        self.marks.append({"f0": self.meter.mark(self.device, "f0", index)})
        for t in _tensors_in(inputs, []):
            step.hooks.append(t.register_hook(functools.partial(self._at, index, "b1")))

    def closed(self, step: Any, group: Any, outputs: Any) -> None:
        super().closed(step, group, outputs)
        index = group.index
        self.marks[index]["f1"] = self.meter.mark(self.device, "f1", index)
        cands = self.candidates.get(index, {})
        self.copies[index] = len(group.copies) if group.offload else len(cands)
        self.at_close = [len(t) for t in self.times]
        tensors = _tensors_in(outputs, [])
        if tensors:
            step.hooks.append(
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._at, index, "b0"), mode="any"
                )
            )

    def count(self, index: int, key: int, nbytes: int) -> None:
        owner = self.owner.setdefault(key, index)
        if owner == index:
            cands = self.candidates.setdefault(index, {})
            cands[key] = max(cands.get(key, 0), nbytes)

    def _at(self, index: int, kind: str, _grad: Any) -> None:
        """``b0``: the call's first output gradient arrived (its backward starts);
        ``b1``: an input gradient is complete (the last one marks the end)."""
        marks = self.marks[index]
        if kind == "b1" or kind not in marks:
            marks[kind] = self.meter.mark(self.device, kind, index)
            if kind == "b0" and index == len(self.marks) - 1:
                self.at_backward = [len(t) for t in self.times]
                # the forward's saves are all alive here: read once (the read costs
                # about as much as a layer call's own bookkeeping)
                self._sample()

    def _sample(self) -> None:
        now = self.meter.allocated(self.device)
        if now is not None:
            self.allocated_max = max(self.allocated_max or 0, now)

    # ---- the result --------------------------------------------------------------------

    def complete(self) -> bool:
        """Every call's backward started and the step's backward ended."""
        return (
            bool(self.marks)
            and self.end is not None
            and all("f1" in m and "b0" in m for m in self.marks)
        )

    def result(self) -> ProbeResult | None:
        """The measurements (waits on the host for the marks once); ``None`` until
        :meth:`complete`."""
        if not self.complete():
            return None
        meter = self.meter
        meter.wait(self.end[0])  # type: ignore[index]
        L = len(self.marks)
        at_backward = self.at_backward or [len(t) for t in self.times]
        out = ProbeResult([], [], [], [], [], [], [], list(self.offloaded), 0.0, self.allocated_max)
        per_copy = self.per_copy / 2
        for i, m in enumerate(self.marks):
            fwd = _seconds(meter, m["f0"], m["f1"])
            host_fwd = m["f1"][1] - m["f0"][1]
            stall = meter.stall_seconds(self.times[i][at_backward[i] :])
            if "b1" in m:
                bwd = _seconds(meter, m["b0"], m["b1"]) - stall
                host_bwd = m["b1"][1] - m["b0"][1]
            elif i == 0 and self.end is not None:  # inputs need no gradient: the end
                bwd = _seconds(meter, m["b0"], self.end) - stall
                host_bwd = self.end[1] - m["b0"][1]
            else:
                bwd, host_bwd = 2.0 * fwd, 2.0 * host_fwd
            stats = self.stats[i]
            if self.offloaded[i]:
                link, freed = stats.bytes_offloaded, stats.bytes_released
                # the host work offloading adds is modelled apart (LayerCost.forward)
                host_fwd = max(0.0, host_fwd - per_copy * self.copies[i])
                host_bwd = max(0.0, host_bwd - per_copy * self.copies[i])
            else:
                link = freed = sum(self.candidates.get(i, {}).values())
            out.forward_s.append(max(0.0, fwd))
            out.backward_s.append(max(0.0, bwd))
            out.host_forward_s.append(max(0.0, host_fwd))
            out.host_backward_s.append(max(0.0, host_bwd))
            out.link_bytes.append(int(link))
            out.freed_bytes.append(int(freed))
            out.copies.append(self.copies[i])
        last = self.marks[L - 1]
        gap_stall = sum(
            meter.stall_seconds(t[a:b]) for t, a, b in zip(self.times, self.at_close, at_backward)
        )
        out.gap_s = max(0.0, _seconds(meter, last["f1"], last["b0"]) - gap_stall)
        self._stand_in(out)
        return out

    def _stand_in(self, out: ProbeResult) -> None:
        """A call that ran recomputed (host memory was short) saved only its inputs and
        recomputed in its backward: its bytes and backward are those of the nearest call
        of the same class that did not, so the policy's costs describe the call itself."""
        plain = [i for i, r in enumerate(self.recomputed) if not r]
        for i, r in enumerate(self.recomputed):
            if not r:
                continue
            same = [j for j in plain if self.kinds[j] is self.kinds[i]]
            if not same:
                continue
            j = min(same, key=lambda j: abs(j - i))
            for name in ("backward_s", "host_backward_s", "link_bytes", "freed_bytes", "copies"):
                values = getattr(out, name)
                values[i] = values[j]


def _seconds(meter: Meter, a: tuple[Any, float], b: tuple[Any, float]) -> float:
    got = meter.seconds(a[0], b[0])
    if got is None:  # waited for the step's end mark: earlier marks are complete
        meter.wait(b[0])
        got = meter.seconds(a[0], b[0])
    return float(got or 0.0)
