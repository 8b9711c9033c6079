"""A read-only view of what an offloader's most recent forward (and its backward) did, per
layer call: planned, offloaded, released, reloaded, dropped, the waits and the auto
decision (:attr:`offload.ActivationOffloader.last_step`). A snapshot: frozen, taken when
read, holding no reference into the runtime."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["LayerView", "StepView", "view_of"]


@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer call (a group) of the step.

    Attributes:
        index: the call's position in the forward (0-based).
        planned: selected for offloading (by the schedule, ``"auto"`` or the caller).
        offloaded: its saves sent bytes to the host.
        released: its device references were dropped after the wait on its copies.
        reloaded: its copies are on the device now (between its reload and its drop).
        dropped: its backward ended and its reload buffers were given up.
        bytes_offloaded: bytes it sent to the host (each storage once).
        bytes_released: device bytes its release freed.
        stall_seconds: how long the compute stream waited for its copies (``None``
            unless timings are recorded: ``timing=True``).
    """

    index: int
    planned: bool
    offloaded: bool
    released: bool
    reloaded: bool
    dropped: bool
    bytes_offloaded: int
    bytes_released: int
    stall_seconds: float | None


@dataclasses.dataclass(frozen=True)
class StepView:
    """The most recent step of an offloader.

    Attributes:
        layers: one :class:`LayerView` per layer call, in call order.
        forward_done: the forward left the offloader's context.
        backward_done: every group with copies finished its backward.
        capture: ``None`` (eager), ``"step"`` (one CUDA graph for the step) or
            ``"layer"`` (per-layer graphs, :func:`offload.make_graphed_callables`).
        manual: driven by the caller (``get_cpu_offload_context``'s manual mode).
        placed_late_at: the call at whose start the first call's saves were placed
            (``None``: at its own close, or nothing was deferred).
        double_buffer_reuses: reload buffers reused (``double_buffering=True``).
        spare_buffers: reload buffers kept for reuse now (0 once the backward ended).
        waits: the compute stream's waits for copies, in seconds, summed over the
            layers (``None`` unless timings are recorded).
        auto: with ``offload_layers="auto"``, the decision of this step (as
            :attr:`offload.OffloadStats.auto`); else ``None``.

    Example:
        >>> import offload, torch
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
        >>> off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
        >>> x = torch.randn(64, 256, requires_grad=True)
        >>> with off:
        ...     y = layers[2](layers[1](layers[0](x)))
        >>> [(la.planned, la.released) for la in off.last_step.layers]
        [(True, True), (True, True), (False, False)]
        >>> y.sum().backward()
        >>> off.last_step.backward_done, [la.dropped for la in off.last_step.layers]
        (True, [True, True, False])
        >>> off.close()
    """

    layers: tuple[LayerView, ...]
    forward_done: bool
    backward_done: bool
    capture: str | None
    manual: bool
    placed_late_at: int | None
    double_buffer_reuses: int
    spare_buffers: int
    waits: float | None
    auto: dict[str, Any] | None


def view_of(source: Any) -> StepView:
    """The view of a step (``offload/activations/_step.py``), or of the captured layer
    calls of :func:`offload.make_graphed_callables` (one step per call, merged)."""
    steps = getattr(source, "steps", None) or [source]
    stats = source.read_stats()
    layers: list[LayerView] = []
    for step in steps:
        with step.rt.lock:
            for g in step.groups:
                s = g.stats
                layers.append(
                    LayerView(
                        index=len(layers),
                        planned=g.offload,
                        offloaded=s.bytes_offloaded > 0,
                        released=g.released,
                        reloaded=g.reloaded,
                        dropped=g.dropped,
                        bytes_offloaded=s.bytes_offloaded,
                        bytes_released=s.bytes_released,
                        stall_seconds=s.stall_seconds,
                    )
                )
    stalls = [la.stall_seconds for la in layers if la.stall_seconds is not None]
    last = steps[-1]
    return StepView(
        layers=tuple(layers),
        forward_done=all(s.forward_done for s in steps),
        backward_done=all(s.backward_done for s in steps),
        capture=last.capture,
        manual=last.manual,
        placed_late_at=last.placed_late_at,
        double_buffer_reuses=sum(s.stats_double_buffer_reuses for s in steps),
        spare_buffers=sum(len(v) for s in steps for v in s.spares.values()),
        waits=sum(stalls) if stalls else None,
        auto=None if stats.auto is None else dict(stats.auto),
    )
