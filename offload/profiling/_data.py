"""What :func:`offload.profile_step` measured, as data: :class:`MemoryProfile` and its
:class:`Timeline` of layer, copy and memory spans. Their rendering is ``_render`` and
their plot ``_plot`` in this package, imported only when a report or plot is asked for."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from offload._core._units import format_bytes
from offload.stats import LayerStats, OffloadStats

__all__ = ["CopySpan", "LayerSpan", "MemoryProfile", "MemorySample", "Timeline"]


@dataclasses.dataclass
class LayerSpan:
    """When one layer call ran, in ms since the start of the profiled step.

    Attributes:
        index: the call's position in the forward (the group index of the stats).
        forward_start_ms, forward_end_ms: the layer's forward (its forward hooks).
        backward_start_ms: when the gradient of the layer's output was ready (the
            layer's backward starts); ``None`` if no output required grad.
        backward_end_ms: when the gradients of its inputs were ready; the end of the step
            when no input required grad (the first layer fed by a plain tensor).
    """

    index: int
    forward_start_ms: float
    forward_end_ms: float
    backward_start_ms: float | None = None
    backward_end_ms: float | None = None


@dataclasses.dataclass
class CopySpan:
    """One timed copy or stall of the offloader, in ms since the start of the step.

    Attributes:
        layer: the layer call (group) it belongs to.
        kind: ``"d2h"`` (to host), ``"h2d"`` (back to the device) or ``"stall"`` (the
            compute stream waiting for a copy).
        start_ms, end_ms: its span. Without an accelerator the copies are synchronous
            and only their durations are measured: a D2H is placed at the start of its
            layer's forward (one after the other), an H2D so that it ends where its
            layer's backward starts (:attr:`Timeline.copies_placed` is ``False``).
    """

    layer: int
    kind: str
    start_ms: float
    end_ms: float


@dataclasses.dataclass
class MemorySample:
    """Device memory allocated (``torch.cuda.memory_allocated``) at a layer boundary.

    Attributes:
        t_ms: ms since the start of the step.
        bytes: bytes allocated at that point of the program.
        label: which boundary (``"L3 forward start"``, ``"L3 backward end"``, ...).
    """

    t_ms: float
    bytes: int
    label: str


@dataclasses.dataclass
class Timeline:
    """One offloaded step on a time axis: layer spans, copies, device memory.

    Attributes:
        clock: ``"cuda_events"`` (device time from CUDA events) or ``"perf_counter"``
            (host clock, no accelerator).
        step_ms: length of the step (forward + backward).
        layers: one :class:`LayerSpan` per layer call.
        copies: every :class:`CopySpan` the offloader timed.
        memory: :class:`MemorySample` at every layer boundary (empty without CUDA).
        copies_placed: ``True`` when copy positions were measured, ``False`` when only
            their durations were (synchronous copies on the CPU).
    """

    clock: str
    step_ms: float
    layers: list[LayerSpan] = dataclasses.field(default_factory=list)
    copies: list[CopySpan] = dataclasses.field(default_factory=list)
    memory: list[MemorySample] = dataclasses.field(default_factory=list)
    copies_placed: bool = True

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """The inverse of :meth:`to_dict` (also after a JSON round trip)."""
        fields = dict(data)
        fields["layers"] = [LayerSpan(**x) for x in fields.get("layers", [])]
        fields["copies"] = [CopySpan(**x) for x in fields.get("copies", [])]
        fields["memory"] = [MemorySample(**x) for x in fields.get("memory", [])]
        return cls(**fields)


@dataclasses.dataclass
class MemoryProfile:
    """What :func:`profile_step` measured: the same step without and with offloading.

    Memory figures are maxima over the measured steps, times are medians (after the
    warm-up steps). Byte counts are bytes; ``GB/s`` is 10^9 bytes per second.

    Attributes:
        device: the device of the offloaded layers (``"cuda:0"``, ``"cpu"``).
        memory_source: ``"cuda_allocator"``: peaks come from
            ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (reset before
            every step) and :attr:`bytes_saved` is the drop of the allocated peak.
            ``"offloader_stats"`` (no accelerator: torch has no device peak to read):
            :attr:`bytes_saved` is the offloader's own ``stats.bytes_released`` and the
            peak fields are ``None``.
        steps, warmup: measured and warm-up steps of each phase.
        step_ms_without, step_ms_with: median step time (forward + backward, CUDA events
            on the compute stream; ``time.perf_counter`` on the CPU).
        step_ms_without_all, step_ms_with_all: every measured step time.
        bytes_saved: peak allocated without minus peak allocated with (see
            ``memory_source``).
        activation_bytes_without, activation_bytes_with: what a step adds to the memory
            allocated before it (peak minus allocated at its start, max over the
            measured steps). On the CPU: the bytes of the distinct storages one step
            saves for backward, parameters and their views excluded (counted in one
            extra step without offloading, through a pass-through saved-tensor hook),
            and that minus :attr:`bytes_saved`.
        peak_allocated_without, peak_allocated_with, peak_reserved_without,
            peak_reserved_with: absolute device peaks (CUDA only, else ``None``).
        host_pool_reserved_bytes: host bytes the offloader's pool holds.
        host_pinned: whether that pool is pinned (page-locked).
        rss_bytes_without, rss_bytes_with: process resident memory after each phase.
        link_d2h_gbps, link_h2d_gbps: pinned memcpy bandwidth, measured once per device (256 MiB
            each way, median of 3; CUDA only, else ``None``).
        stats: the offloader's stats of the last measured offloaded step, with copy and
            stall times (``timing=True`` during the profile).
        timeline: one extra offloaded step on a time axis (see :class:`Timeline`).
        torch_version: ``torch.__version__`` of the run.

    Example:
        >>> import offload, torch
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
        >>> off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
        >>> def step():
        ...     with off:
        ...         y = torch.randn(64, 256)
        ...         for layer in layers:
        ...             y = torch.relu(layer(y))
        ...     y.square().mean().backward()
        >>> p = offload.profile_step(step, off, steps=2)
        >>> p.steps, p.stats.bytes_offloaded > 0, p.step_ms_with > 0
        (2, True, True)
        >>> off.close()
    """

    device: str
    memory_source: str
    steps: int
    warmup: int
    step_ms_without: float
    step_ms_with: float
    step_ms_without_all: list[float]
    step_ms_with_all: list[float]
    bytes_saved: int
    activation_bytes_without: int
    activation_bytes_with: int
    peak_allocated_without: int | None
    peak_allocated_with: int | None
    peak_reserved_without: int | None
    peak_reserved_with: int | None
    host_pool_reserved_bytes: int
    host_pinned: bool
    rss_bytes_without: int
    rss_bytes_with: int
    link_d2h_gbps: float | None
    link_h2d_gbps: float | None
    stats: OffloadStats
    timeline: Timeline | None
    torch_version: str = torch.__version__

    # ---- derived figures ------------------------------------------------------------

    @property
    def time_ratio(self) -> float:
        """Median step time with offloading over median step time without."""
        return self.step_ms_with / self.step_ms_without if self.step_ms_without > 0 else 1.0

    @property
    def copy_seconds(self) -> float | None:
        """Total D2H + H2D copy time of the last measured step (``None`` if untimed)."""
        layers = [la for la in self.stats.layers if la.d2h_seconds is not None]
        if not layers:
            return None
        return sum((la.d2h_seconds or 0.0) + (la.h2d_seconds or 0.0) for la in layers)

    @property
    def stall_seconds(self) -> float | None:
        """Total time the compute stream waited for copies (``None`` if untimed)."""
        layers = [la for la in self.stats.layers if la.stall_seconds is not None]
        return sum(la.stall_seconds or 0.0 for la in layers) if layers else None

    @property
    def d2h_gbps(self) -> float | None:
        """Achieved device-to-host rate: bytes offloaded / D2H copy time."""
        seconds = sum(la.d2h_seconds or 0.0 for la in self.stats.layers)
        return self.stats.bytes_offloaded / seconds / 1e9 if seconds > 0 else None

    @property
    def h2d_gbps(self) -> float | None:
        """Achieved host-to-device rate: bytes reloaded / H2D copy time."""
        seconds = sum(la.h2d_seconds or 0.0 for la in self.stats.layers)
        return self.stats.bytes_reloaded / seconds / 1e9 if seconds > 0 else None

    @property
    def copies_hidden(self) -> float | None:
        """``1 - total stall / total copy time`` (clamped to [0, 1]): the share of copy
        time the compute stream did not wait for. ``None`` without an accelerator (the
        copies are synchronous there: nothing overlaps) or when nothing was copied."""
        copy_s, stall_s = self.copy_seconds, self.stall_seconds
        if self.memory_source != "cuda_allocator" or not copy_s:
            return None
        return min(1.0, max(0.0, 1.0 - (stall_s or 0.0) / copy_s))

    def verdict(self) -> str:
        """One line, e.g. ``saved 4.4 GiB of 5.8 GiB (76%) for +3.1% step time; copies
        hidden 97%``. Without an accelerator it claims no saving: it says that the
        schedule ran synchronously and that there is no device memory to save."""
        if self.stats.bytes_offloaded == 0:
            return (
                "nothing was offloaded (every saved tensor stayed on the device: see the "
                "reasons above)"
            )
        share = (
            f" ({100 * self.bytes_saved / self.activation_bytes_without:.0f}%)"
            if self.activation_bytes_without > 0
            else ""
        )
        if self.memory_source != "cuda_allocator":  # no accelerator: nothing to save
            from offload.profiling._render import SYNCHRONOUS

            return (
                f"{SYNCHRONOUS}; its copies took {format_bytes(self.bytes_saved)} of the "
                f"{format_bytes(self.activation_bytes_without)}{share} saved per step to "
                f"host memory, at {100 * (self.time_ratio - 1):+.1f}% step time on this host"
            )
        text = (
            f"saved {format_bytes(self.bytes_saved)} of "
            f"{format_bytes(self.activation_bytes_without)}{share} for "
            f"{100 * (self.time_ratio - 1):+.1f}% step time"
        )
        hidden = self.copies_hidden
        if hidden is not None:
            text += f"; copies hidden {100 * hidden:.0f}%"
        return text

    # ---- conversions ----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (plain ints, floats, strings, lists, dicts and ``None``);
        :meth:`from_dict` rebuilds an equal profile from it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryProfile:
        """The inverse of :meth:`to_dict`, also after a JSON round trip.

        Example:
            >>> import json
            >>> p = MemoryProfile.from_dict(_example_dict())
            >>> MemoryProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
            True
        """
        fields = dict(data)
        fields["stats"] = OffloadStats.from_dict(fields["stats"])
        if fields.get("timeline") is not None:
            fields["timeline"] = Timeline.from_dict(fields["timeline"])
        return cls(**fields)

    # ---- output ---------------------------------------------------------------------

    def report(self, console: Any = None) -> None:
        """Print the per-layer table, a legend, the totals and the verdict with rich.

        Args:
            console: a :class:`rich.console.Console`. Default ``None``: a new one on
                stdout. The table fits 80 columns.
        """
        import offload.profiling._render as _render

        _render.render_profile(self, console)

    def plot(self, path: str | Any) -> None:
        """Write a PNG of :attr:`timeline`: the compute stream (forward and backward span
        of every layer call, stalls in red), the D2H and the H2D copy streams on a
        common time axis, and device memory allocated over the step below.

        Works from a profile loaded with :meth:`from_dict` on a machine without a GPU.

        Args:
            path: file to write (PNG; any format matplotlib knows by its suffix).

        Raises:
            ImportError: matplotlib is not installed (``pip install "offload[plot]"``).
            ValueError: the profile has no timeline.
        """
        import offload.profiling._plot as _plot

        _plot.save_profile_plot(self, path)


def _example_dict() -> dict[str, Any]:
    """A small profile as a dict (doctests and tests)."""
    stats = OffloadStats(bytes_offloaded=3 << 20, bytes_released=2 << 20, bytes_reloaded=3 << 20)
    stats.layers = [
        LayerStats(
            0,
            True,
            3 << 20,
            bytes_released=2 << 20,
            d2h_seconds=1e-3,
            h2d_seconds=1e-3,
            stall_seconds=1e-4,
        ),
        LayerStats(1, False, d2h_seconds=0.0, h2d_seconds=0.0, stall_seconds=0.0),
    ]
    stats.layers[1].bytes_kept["not_selected"] = 3 << 20
    stats.bytes_kept["not_selected"] = 3 << 20
    timeline = Timeline(
        "cuda_events",
        10.0,
        [LayerSpan(0, 0.1, 2.0, 6.0, 9.5), LayerSpan(1, 2.0, 4.0, 4.5, 6.0)],
        [
            CopySpan(0, "d2h", 0.5, 1.5),
            CopySpan(0, "h2d", 4.5, 5.5),
            CopySpan(0, "stall", 6.0, 6.1),
        ],
        [MemorySample(0.0, 1 << 20, "start"), MemorySample(4.0, 7 << 20, "L1 forward end")],
    )
    p = MemoryProfile(
        device="cuda:0",
        memory_source="cuda_allocator",
        steps=3,
        warmup=1,
        step_ms_without=9.0,
        step_ms_with=10.0,
        step_ms_without_all=[9.0, 9.1, 8.9],
        step_ms_with_all=[10.0, 10.2, 9.9],
        bytes_saved=2 << 20,
        activation_bytes_without=8 << 20,
        activation_bytes_with=6 << 20,
        peak_allocated_without=9 << 20,
        peak_allocated_with=7 << 20,
        peak_reserved_without=10 << 20,
        peak_reserved_with=8 << 20,
        host_pool_reserved_bytes=64 << 20,
        host_pinned=True,
        rss_bytes_without=1 << 30,
        rss_bytes_with=1 << 30,
        link_d2h_gbps=55.2,
        link_h2d_gbps=55.4,
        stats=stats,
        timeline=timeline,
    )
    return p.to_dict()
