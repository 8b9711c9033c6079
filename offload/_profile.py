"""Measure what offloading saves on the user's own model: :func:`profile_step` and the
:class:`MemoryProfile` it returns (report, JSON, timeline plot).

Every access to private state of :class:`~offload.ActivationOffloader` (and of the step
it keeps) is in :func:`_internals`, so that a rename there needs one change here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from offload.profiling import OffloadStats, format_bytes

__all__ = [
    "CopySpan",
    "LayerSpan",
    "MemoryProfile",
    "MemorySample",
    "Timeline",
    "profile_step",
]

#: Bytes of each pinned <-> device copy that measures the link bandwidth.
LINK_PROBE_BYTES = 256 * 2**20
_LINK_REPEATS = 3
_PLOT_HINT = 'MemoryProfile.plot needs matplotlib: pip install "offload[plot]"'


# --------------------------------------------------------------------------------------
# the data


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
        link_d2h_gbps, link_h2d_gbps: pinned memcpy bandwidth measured once (256 MiB
            each way, median of 3; CUDA only, else ``None``).
        stats: the offloader's stats of the last measured offloaded step, with copy and
            stall times (``timing=True`` during the profile).
        timeline: one extra offloaded step on a time axis (see :class:`Timeline`).
        torch_version: ``torch.__version__`` of the run.
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
        hidden 97%``."""
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
        text = (
            f"saved {format_bytes(self.bytes_saved)} of "
            f"{format_bytes(self.activation_bytes_without)}{share} for "
            f"{100 * (self.time_ratio - 1):+.1f}% step time"
        )
        hidden = self.copies_hidden
        if hidden is not None:
            text += f"; copies hidden {100 * hidden:.0f}%"
        elif self.memory_source != "cuda_allocator":
            text += "; copies synchronous (no accelerator)"
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
        from offload import _render

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
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as exc:
            raise ImportError(_PLOT_HINT) from exc
        if self.timeline is None:
            raise ValueError("this profile has no timeline to plot")
        _draw(self, Figure, Patch).savefig(path, dpi=110)


def _draw(p: MemoryProfile, Figure: Any, Patch: Any) -> Any:
    """The figure of :meth:`MemoryProfile.plot`."""
    import matplotlib

    tl = p.timeline
    fig = Figure(figsize=(13, 6.5), layout="constrained")
    ax, mem = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    cmap = matplotlib.colormaps["tab20"]
    n = max(1, len(tl.layers))

    def color(i: int) -> Any:
        return cmap(i % 20) if n > 10 else cmap((2 * i) % 20)

    lanes = {"compute": 2.0, "d2h": 1.0, "h2d": 0.0}
    height = 0.7
    for span in tl.layers:
        bars = [(span.forward_start_ms, span.forward_end_ms, "", f"F{span.index}")]
        if span.backward_start_ms is not None and span.backward_end_ms is not None:
            bars.append((span.backward_start_ms, span.backward_end_ms, "///", f"B{span.index}"))
        for start, end, hatch, label in bars:
            width = max(end - start, 1e-6)
            ax.broken_barh(
                [(start, width)],
                (lanes["compute"] - height / 2, height),
                facecolors=color(span.index),
                edgecolor="black",
                linewidth=0.4,
                hatch=hatch,
            )
            if width > tl.step_ms / 60:
                ax.text(
                    start + width / 2, lanes["compute"], label, ha="center", va="center", fontsize=7
                )
    for c in tl.copies:
        width = max(c.end_ms - c.start_ms, 1e-6)
        if c.kind == "stall":
            ax.broken_barh(
                [(c.start_ms, width)], (lanes["compute"] + height / 2, 0.2), facecolors="red"
            )
            continue
        lane = lanes.get(c.kind)
        if lane is None:
            continue
        ax.broken_barh(
            [(c.start_ms, width)],
            (lane - height / 2, height),
            facecolors=color(c.layer),
            edgecolor="black",
            linewidth=0.3,
        )
    ax.set_yticks(
        [lanes["h2d"], lanes["d2h"], lanes["compute"]], ["H2D stream", "D2H stream", "compute"]
    )
    ax.set_ylim(-0.6, 3.3)
    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="black", label="forward of layer i (Fi)"),
            Patch(
                facecolor="white", edgecolor="black", hatch="///", label="backward of layer i (Bi)"
            ),
            Patch(facecolor="red", label="stall: compute waits for a copy"),
        ],
        loc="upper right",
        ncols=3,
        fontsize=8,
    )
    placed = "" if tl.copies_placed else " (CPU: copy durations measured, positions approximate)"
    ax.set_title(f"offload profile on {p.device}: {p.verdict()}{placed}", fontsize=10)
    if tl.memory:
        unit, scale = ("GiB", 2**30) if max(m.bytes for m in tl.memory) >= 2**30 else ("MiB", 2**20)
        xs = [m.t_ms for m in tl.memory]
        ys = [m.bytes / scale for m in tl.memory]
        mem.step(xs, ys, where="post", color="tab:blue")
        mem.plot(xs, ys, "o", markersize=2, color="tab:blue")
        mem.set_ylabel(f"allocated {unit}")
    else:
        mem.text(
            0.5,
            0.5,
            f"device memory not measured on {p.device}",
            ha="center",
            va="center",
            transform=mem.transAxes,
        )
        mem.set_yticks([])
    mem.set_xlabel(f"ms since the start of the step ({tl.clock})")
    mem.set_xlim(0, max(tl.step_ms, 1e-3))
    return fig


def _example_dict() -> dict[str, Any]:
    """A small profile as a dict (doctests and tests)."""
    from offload.profiling import LayerStats

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


# --------------------------------------------------------------------------------------
# the offloader's internals, in one place


def _internals(offloader: Any) -> types.SimpleNamespace:
    """Every use of private state of ``offloader`` (an ActivationOffloader) by the
    profiler. Returns:

    * ``layers``: the registered layer modules, in order (``offloader._layers``);
    * ``with_config(cfg)``: a context manager that makes ``cfg`` the config of the
      offloader and of its runtime (which the steps made meanwhile keep), then restores
      both (``offloader.config``, ``offloader._runtime.config``);
    * ``disabled()``: a context manager during which ``with offloader:`` is a no-op
      (``offloader._disabled``: no hooks at all); it yields a callable returning how
      many times the context was entered;
    * ``last_step()``: the object of the most recent forward (``offloader._last``);
    * ``copy_records()``: ``[(group index, record), ...]`` of that forward, each record
      ``(kind, start_event, end_event)`` (CUDA) or ``(kind, seconds)`` (synchronous
      path), ``kind`` in ``d2h``/``h2d``/``stall`` (``_last.groups[i].times``).
    """
    from offload.activations import ActivationOffloader

    if not isinstance(offloader, ActivationOffloader):
        raise TypeError(
            f"offloader must be an offload.ActivationOffloader; got {type(offloader).__name__}"
        )

    @contextlib.contextmanager
    def with_config(cfg: Any) -> Iterator[None]:
        old = offloader.config, offloader._runtime.config
        offloader.config = offloader._runtime.config = cfg
        try:
            yield
        finally:
            offloader.config, offloader._runtime.config = old

    @contextlib.contextmanager
    def disabled() -> Iterator[Callable[[], int]]:
        old = offloader._disabled, offloader._disabled_entries
        offloader._disabled, offloader._disabled_entries = True, 0
        try:
            yield lambda: offloader._disabled_entries
        finally:
            offloader._disabled, offloader._disabled_entries = old

    def copy_records() -> list[tuple[int, tuple[Any, ...]]]:
        step = offloader._last
        if step is None:
            return []
        return [(g.index, rec) for g in step.groups for rec in (g.times or ())]

    return types.SimpleNamespace(
        layers=list(offloader._layers),
        with_config=with_config,
        disabled=disabled,
        last_step=lambda: offloader._last,
        copy_records=copy_records,
    )


# --------------------------------------------------------------------------------------
# measuring


@dataclasses.dataclass
class _Phase:
    ms: list[float]
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    activation: int | None = None


def _device_of(layers: list[torch.nn.Module]) -> torch.device:
    for layer in layers:
        for t in (*layer.parameters(), *layer.buffers()):
            if t.device.type == "cuda":
                index = (
                    t.device.index if t.device.index is not None else torch.cuda.current_device()
                )
                return torch.device("cuda", index)
            return t.device
    return torch.device("cpu")


def _settle(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _link_bandwidth(device: torch.device) -> tuple[float, float]:
    """Pinned host <-> device memcpy GB/s (D2H, H2D) on ``LINK_PROBE_BYTES``, median of
    ``_LINK_REPEATS`` after one warm-up copy, CUDA events on the current stream."""
    dev = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        times = []
        for _ in range(_LINK_REPEATS):
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        rates.append(LINK_PROBE_BYTES / (statistics.median(times) * 1e-3) / 1e9)
    del dev, host
    _settle(device)
    return rates[0], rates[1]


def _run_phase(
    step_fn: Callable[[], Any],
    params: list[torch.Tensor],
    device: torch.device,
    steps: int,
    warmup: int,
    tick: Callable[[], None],
) -> _Phase:
    """``warmup + steps`` steps; time and (CUDA) memory of the last ``steps``."""
    cuda = device.type == "cuda"
    _settle(device)
    phase = _Phase(ms=[])
    peaks: list[tuple[int, int, int]] = []
    for i in range(warmup + steps):
        for p in params:
            p.grad = None
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step_fn()
            end.record()
            torch.cuda.synchronize(device)
            ms = start.elapsed_time(end)
            peak = torch.cuda.max_memory_allocated(device)
            peaks.append((peak, torch.cuda.max_memory_reserved(device), peak - before))
        else:
            t0 = time.perf_counter()
            step_fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            phase.ms.append(ms)
        else:
            peaks.clear()
        tick()
    if peaks:
        phase.peak_allocated = max(p[0] for p in peaks)
        phase.peak_reserved = max(p[1] for p in peaks)
        phase.activation = max(p[2] for p in peaks)
    return phase


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


class _Recorder:
    """Marks layer boundaries of one step: forward hooks for the forward, tensor hooks
    on each layer call's inputs and outputs for the backward (the gradient of an output
    is ready: backward starts; the gradients of the inputs are: it ends)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[tuple[str, int, Any, int | None]] = []
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
        spans = {
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


def _timeline_step(
    step_fn: Callable[[], Any],
    params: list[torch.Tensor],
    device: torch.device,
    inner: types.SimpleNamespace,
) -> Timeline:
    recorder = _Recorder(device)
    for p in params:
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    handles = recorder.attach(inner.layers)
    try:
        recorder.begin()
        step_fn()
        recorder.finish()
    finally:
        for h in handles:
            h.remove()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return recorder.timeline(inner.copy_records())


def _saved_bytes(step_fn: Callable[[], Any], params: list[torch.Tensor]) -> int:
    """Run ``step_fn`` once (offloader disabled) and count the bytes of the distinct
    storages autograd saves for backward, parameters and their views excluded (a leaf
    that requires grad, a view of one, or a storage of ``params``)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        is_param = (base.is_leaf and base.requires_grad) or (
            t.untyped_storage().data_ptr() in param_ptrs
        )
        if not is_param and t.layout == torch.strided and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step_fn()
    seen.pop(0, None)
    return sum(seen.values())


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")


def profile_step(
    step_fn: Callable[[], Any],
    offloader: Any,
    *,
    steps: int = 3,
    warmup: int = 1,
    parameters: Iterable[torch.Tensor] | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
) -> MemoryProfile:
    """Measure what offloading saves, and costs, on your own training step.

    ``step_fn()`` runs one forward and backward of your model (no optimizer step) and
    must itself enter ``with offloader:`` around the forward, as in training. It is run
    ``warmup + steps`` times with offloading disabled, then ``warmup + steps`` times
    enabled, then once more to record a timeline, all on the same model and state:

    * **Without offloading** ``with offloader:`` does nothing at all: no layer hooks and
      no saved-tensor hooks are installed, so the baseline is the model as it runs
      without this library.
    * **With offloading** the offloader runs with its own settings plus ``timing=True``
      (copies and stalls timed; restored afterwards).
    * **Gradients**: before every step, ``.grad`` of every tensor of ``parameters`` is
      set to ``None`` (as ``optimizer.zero_grad()`` does), so each step starts from the
      same memory. Gradients of parameters not listed accumulate across steps (the same
      way in both phases).
    * **Memory** (CUDA): ``torch.cuda.reset_peak_memory_stats`` before each step, then
      ``max_memory_allocated``/``max_memory_reserved`` after it; the profile keeps the
      maximum over the measured steps (``bytes_saved`` = peak without - peak with). The
      caching allocator's free blocks are released (``empty_cache``) before each phase.
      Without an accelerator torch has no device peak: ``bytes_saved`` is the
      offloader's ``stats.bytes_released`` and ``memory_source`` says so.
    * **Time**: medians over the measured steps of CUDA events recorded around
      ``step_fn()`` on the current stream (``time.perf_counter`` on the CPU).

    Also measured: the pinned link bandwidth (CUDA), the host pool and the process RSS.

    Args:
        step_fn: ``callable()`` running forward (inside ``with offloader:``) and
            backward; its return value is ignored.
        offloader: the :class:`~offload.ActivationOffloader` that ``step_fn`` enters.
        steps: measured steps per phase (>= 1). Default ``3``.
        warmup: unmeasured steps before them (>= 0). Default ``1``.
        parameters: tensors whose ``.grad`` is set to ``None`` before every step.
            Default ``None``: the parameters of the offloader's layers. Pass
            ``model.parameters()`` to cover the whole model.
        on_step: ``callable(phase, done, total)`` called after every step, ``phase`` in
            ``"without"``, ``"with"``, ``"timeline"`` (progress display). Default ``None``.

    Returns:
        A :class:`MemoryProfile` (``report()``, ``to_dict()``, ``plot(path)``).

    Raises:
        TypeError: ``offloader`` is not an ActivationOffloader, ``step_fn`` is not
            callable, or ``steps``/``warmup`` is not an int.
        ValueError: ``steps`` < 1 or ``warmup`` < 0.
        RuntimeError: ``step_fn`` did not enter ``with offloader:``.

    Example:
        >>> import offload, torch
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
        >>> off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
        >>> x = torch.randn(64, 256)
        >>> def step():
        ...     with off:
        ...         y = x
        ...         for layer in layers:
        ...             y = torch.relu(layer(y))
        ...     y.square().mean().backward()
        >>> profile = offload.profile_step(step, off, steps=2)
        >>> profile.memory_source, profile.bytes_saved > 0
        ('offloader_stats', True)
        >>> off.close()
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable; got {type(step_fn).__name__}")
    inner = _internals(offloader)
    _check_count("steps", steps, 1)
    _check_count("warmup", warmup, 0)
    layers = inner.layers
    device = _device_of(layers)
    cuda = device.type == "cuda"
    if parameters is None:
        params = list(dict.fromkeys(p for layer in layers for p in layer.parameters()))
    else:
        params = list(parameters)
    total = 2 * (warmup + steps) + 1
    done = 0

    def ticker(phase: str) -> Callable[[], None]:
        def tick() -> None:
            nonlocal done
            done += 1
            if on_step is not None:
                on_step(phase, done, total)

        return tick

    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        link = _link_bandwidth(device) if cuda else (None, None)
        with inner.disabled() as entries:
            without = _run_phase(step_fn, params, device, steps, warmup, ticker("without"))
            if entries() == 0:
                raise RuntimeError(
                    "step_fn never entered `with offloader:`; profile_step needs a step "
                    "function that runs its forward inside the offloader's context"
                )
            if not cuda:  # no allocator peak: count what a step saves for backward
                for p in params:
                    p.grad = None
                saved_for_backward = _saved_bytes(step_fn, params)
        rss_without = _rss()
        timed = dataclasses.replace(offloader.config, timing=True)
        with inner.with_config(timed):
            before = inner.last_step()
            with_ = _run_phase(step_fn, params, device, steps, warmup, ticker("with"))
            if inner.last_step() is before:
                raise RuntimeError(
                    "step_fn never entered `with offloader:`; profile_step needs a step "
                    "function that runs its forward inside the offloader's context"
                )
            stats = OffloadStats.from_dict(offloader.stats.to_dict())  # the last measured
            timeline = _timeline_step(step_fn, params, device, inner)
            ticker("timeline")()
        rss_with = _rss()

    if cuda:
        saved = without.peak_allocated - with_.peak_allocated
        act_without, act_with = without.activation, with_.activation
        source = "cuda_allocator"
    else:
        saved = stats.bytes_released
        act_without = saved_for_backward
        act_with = act_without - saved
        source = "offloader_stats"
    return MemoryProfile(
        device=str(device),
        memory_source=source,
        steps=steps,
        warmup=warmup,
        step_ms_without=float(statistics.median(without.ms)),
        step_ms_with=float(statistics.median(with_.ms)),
        step_ms_without_all=[float(x) for x in without.ms],
        step_ms_with_all=[float(x) for x in with_.ms],
        bytes_saved=int(saved),
        activation_bytes_without=int(act_without),
        activation_bytes_with=int(act_with),
        peak_allocated_without=without.peak_allocated,
        peak_allocated_with=with_.peak_allocated,
        peak_reserved_without=without.peak_reserved,
        peak_reserved_with=with_.peak_reserved,
        host_pool_reserved_bytes=int(stats.host_pool_reserved_bytes),
        host_pinned=bool(cuda and offloader.config.pin_memory),
        rss_bytes_without=rss_without,
        rss_bytes_with=rss_with,
        link_d2h_gbps=link[0],
        link_h2d_gbps=link[1],
        stats=stats,
        timeline=timeline,
    )
