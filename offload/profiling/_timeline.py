"""One offloaded step on a time axis: layer spans, copies and device memory
(:class:`~offload.profiling.Timeline`), recorded for :func:`offload.profile_step`.

Forward hooks mark each layer call's forward; tensor hooks on its inputs and outputs
mark its backward (the gradient of an output is ready: the backward starts; the
gradients of the inputs are: it ends). Copy spans come from the offloader's timing
records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from offload.profiling._data import CopySpan, LayerSpan, MemorySample, Timeline

__all__ = ["Recorder", "record_timeline"]


def _grad_tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """Tensors requiring grad in a layer's inputs or outputs (tensor, tuple, dict)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            _grad_tensors(item, out, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            _grad_tensors(item, out, depth + 1)
    return out


class Recorder:
    """Marks layer boundaries of one step: forward hooks for the forward, tensor hooks
    on each layer call's inputs and outputs for the backward (the gradient of an output
    is ready: backward starts; the gradients of the inputs are: it ends)."""

    def __init__(self, device: torch.device, peaks: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[tuple[str, int, Any, int | None]] = []
        #: with ``peaks`` (CUDA): ``(kind, index, bytes)`` at every mark, the most
        #: allocated since the mark before (the allocator's peak, reset at each mark)
        self.peaks: list[tuple[str, int, int]] | None = [] if peaks and self.cuda else None
        self.calls = 0
        self.stack: list[int] = []
        self.depth = 0
        self.start: Any = None
        self.end: Any = None
        self.edges: list[tuple[Any, int, str]] = []  # memory at the start and end (CUDA)

    def stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        self.start = self.stamp()
        if self.cuda:
            self.edges.append((self.start, torch.cuda.memory_allocated(self.device), "step start"))

    def finish(self) -> None:
        self.end = self.stamp()
        if self.cuda:
            self.edges.append((self.end, torch.cuda.memory_allocated(self.device), "step end"))

    def mark(self, kind: str, index: int) -> None:
        mem = torch.cuda.memory_allocated(self.device) if self.cuda else None
        self.marks.append((kind, index, self.stamp(), mem))
        if self.peaks is not None:  # host-side counters: no synchronisation
            self.peaks.append((kind, index, torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)

    def attach(self, layers: Iterable[torch.nn.Module]) -> list[Any]:
        handles = []
        for module in dict.fromkeys(layers):
            handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        return handles

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        index = self.calls
        self.calls += 1
        self.stack.append(index)
        self.mark("forward_start", index)
        for t in _grad_tensors((args, kwargs), []):
            t.register_hook(lambda _g, i=index: self.mark("backward_end", i))

    def _post(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        index = self.stack.pop()
        self.mark("forward_end", index)
        for t in _grad_tensors(output, []):
            t.register_hook(lambda _g, i=index: self.mark("backward_start", i))

    def ms(self, stamp: Any) -> float:
        if self.cuda:
            return float(self.start.elapsed_time(stamp))
        return (stamp - self.start) * 1e3

    def timeline(self, records: list[tuple[int, tuple[Any, ...]]]) -> Timeline:
        step_ms = self.ms(self.end)
        spans: dict[int, dict[str, Any]] = {
            i: {
                "forward_start": None,
                "forward_end": None,
                "backward_start": [],
                "backward_end": [],
            }
            for i in range(self.calls)
        }
        memory = [MemorySample(self.ms(stamp), int(mem), label) for stamp, mem, label in self.edges]
        for kind, index, stamp, mem in self.marks:
            t = self.ms(stamp)
            slot = spans[index]
            if kind.startswith("forward"):
                slot[kind] = t
            else:
                slot[kind].append(t)
            if mem is not None:
                memory.append(MemorySample(t, int(mem), f"L{index} {kind.replace('_', ' ')}"))
        layers = []
        for i, s in spans.items():
            fwd_start = s["forward_start"] if s["forward_start"] is not None else 0.0
            layers.append(
                LayerSpan(
                    index=i,
                    forward_start_ms=fwd_start,
                    forward_end_ms=s["forward_end"] if s["forward_end"] is not None else fwd_start,
                    backward_start_ms=min(s["backward_start"]) if s["backward_start"] else None,
                    backward_end_ms=max(s["backward_end"]) if s["backward_end"] else step_ms,
                )
            )
        memory.sort(key=lambda m: m.t_ms)
        if self.cuda:
            copies = [
                CopySpan(g, rec[0], self.ms(rec[1]), self.ms(rec[2]))
                for g, rec in records
                if len(rec) == 3
            ]
            return Timeline("cuda_events", step_ms, layers, copies, memory, copies_placed=True)
        return Timeline(
            "perf_counter",
            step_ms,
            layers,
            _place_cpu(layers, records),
            memory,
            copies_placed=False,
        )


def _place_cpu(
    layers: list[LayerSpan], records: list[tuple[int, tuple[Any, ...]]]
) -> list[CopySpan]:
    """Synchronous copies have durations only: D2H from the start of the layer's forward,
    one after the other; H2D ending where the layer's backward starts."""
    by_index = {la.index: la for la in layers}
    cursor: dict[tuple[int, str], float] = {}
    out = []
    for g, rec in records:
        if len(rec) != 2 or g not in by_index:
            continue
        kind, seconds = rec
        ms = float(seconds) * 1e3
        span = by_index[g]
        if kind == "h2d":
            end = cursor.get((g, kind), span.backward_start_ms or span.forward_end_ms)
            out.append(CopySpan(g, kind, end - ms, end))
            cursor[(g, kind)] = end - ms
        else:
            start = cursor.get((g, kind), span.forward_start_ms)
            out.append(CopySpan(g, kind, start, start + ms))
            cursor[(g, kind)] = start + ms
    return out


def record_timeline(
    step_fn: Callable[[], Any],
    params: list[torch.Tensor],
    device: torch.device,
    layers: list[torch.nn.Module],
    copy_records: Callable[[], list[tuple[int, tuple[Any, ...]]]],
) -> Timeline:
    """Run ``step_fn`` once (gradients of ``params`` set to ``None`` first) with the
    layer boundaries of ``layers`` recorded; ``copy_records()`` gives the offloader's
    timing records of that step afterwards."""
    recorder = Recorder(device)
    for p in params:
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    handles = recorder.attach(layers)
    try:
        recorder.begin()
        step_fn()
        recorder.finish()
    finally:
        for h in handles:
            h.remove()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return recorder.timeline(copy_records())
