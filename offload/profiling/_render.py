"""Text rendering (rich) of :class:`offload.OffloadStats` and :class:`offload.MemoryProfile`.
The data stays data only; :mod:`offload.stats` calls this module as registered by the
package (Note [rendering]). Tables fit an 80-column terminal: short headers, sizes as
``704.5M`` (binary units) and a legend line that spells both out. Plans render in
``offload/_planner/report.py``, with the helpers here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offload._core._units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from offload.profiling._data import LayerStats, MemoryProfile, OffloadStats

__all__ = [
    "LEGEND",
    "layer_table",
    "largest_reason",
    "ms_text",
    "profile_lines",
    "render_profile",
    "render_stats",
    "short_bytes",
    "stats_summary",
]

#: Said once, in place of freed device memory, where the copies ran synchronously
SYNCHRONOUS = (
    "no accelerator: the schedule ran synchronously, moving the bytes to host memory as "
    "it would on a GPU, but there is no device memory to save"
)

#: What the short headers and the sizes of :func:`layer_table` mean.
LEGEND = (
    "#: layer call; off: offloaded; sent: bytes sent to host; freed: device bytes freed "
    "when the layer was released; kept: bytes that stayed on the device, reason: the "
    "largest reason; K/M/G = KiB/MiB/GiB"
)
_LEGEND_TIMES = (
    "; D2H ms / H2D ms: copy time to host / back; stall ms: compute stream waiting for copies"
)


def short_bytes(n: int | float) -> str:
    """Bytes in at most 7 characters: ``0``, ``512B``, ``1.5K``, ``704.5M``, ``4.4G``
    (binary units)."""
    value = float(n)
    if value == 0:
        return "0"
    if abs(value) < 1024:
        return f"{value:.0f}B"
    for unit in ("K", "M", "G", "T"):
        value /= 1024
        if abs(value) < 1024 or unit == "T":
            return f"{value:.1f}{unit}"
    return f"{value:.1f}T"  # unreachable


def ms_text(seconds: float | None) -> str:
    """Seconds as milliseconds in at most 8 characters: ``13.40``, ``127.3``, ``15802``;
    ``-`` for ``None``."""
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    if ms < 100:
        return f"{ms:.2f}"
    return f"{ms:.1f}" if ms < 10000 else f"{ms:.0f}"


def largest_reason(bytes_kept: dict[str, int]) -> str:
    """The keep reason with the most bytes, ``'-'`` when nothing was kept."""
    if not sum(bytes_kept.values()):
        return "-"
    return max(bytes_kept, key=bytes_kept.__getitem__)


def layer_table(stats: OffloadStats, title: str) -> Any:
    """A :class:`rich.table.Table`: one row per layer call and a total row, at most 77
    columns wide with timings (``stats`` timed with ``timing=True``)."""
    from rich import box
    from rich.table import Table

    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
        min_width=min(len(title), 77),  # the title on one line
    )
    timed = any(layer.d2h_seconds is not None for layer in stats.layers)
    freed = not stats.synchronous  # no device memory to free without an accelerator
    headers = ["#", "off", "sent", "freed", "kept", "reason"]
    if not freed:
        headers.remove("freed")
    if timed:
        headers += ["D2H ms", "H2D ms", "stall ms"]
    for name in headers:
        table.add_column(name, justify="left" if name == "reason" else "right", overflow="fold")
    for layer in stats.layers:
        cells = _layer_cells(layer, timed)
        table.add_row(*(cells if freed else cells[:3] + cells[4:]))
    totals = [
        "all",
        "",
        short_bytes(stats.bytes_offloaded),
        short_bytes(stats.bytes_released),
        short_bytes(sum(stats.bytes_kept.values())),
        "",
    ]
    if not freed:
        del totals[3]
    if timed:
        for field in ("d2h_seconds", "h2d_seconds", "stall_seconds"):
            totals.append(ms_text(sum(getattr(la, field) or 0.0 for la in stats.layers)))
    table.add_section()
    table.add_row(*totals)
    return table


def _layer_cells(layer: LayerStats, timed: bool) -> list[str]:
    cells = [
        str(layer.index),
        "yes" if layer.offloaded else "no",
        short_bytes(layer.bytes_offloaded),
        short_bytes(layer.bytes_released),
        short_bytes(sum(layer.bytes_kept.values())),
        largest_reason(layer.bytes_kept),
    ]
    if timed:
        cells += [
            ms_text(layer.d2h_seconds),
            ms_text(layer.h2d_seconds),
            ms_text(layer.stall_seconds),
        ]
    return cells


def legend(stats: OffloadStats) -> str:
    """The legend line of :func:`layer_table` for ``stats``."""
    timed = any(layer.d2h_seconds is not None for layer in stats.layers)
    text = LEGEND
    if stats.synchronous:
        text = text.replace("freed: device bytes freed when the layer was released; ", "")
    return text + (_LEGEND_TIMES if timed else "") + "."


def _auto_text(auto: dict | None) -> str:
    """``stats.auto`` in one sentence: the reason, the predicted and measured ratios
    against no offloading, and the memory reason when memory forced more offloading."""
    if not auto:
        return ""
    parts = [str(auto.get("reason", ""))]
    ratios = []
    if auto.get("predicted_ratio") is not None:
        ratios.append(f"predicted {auto['predicted_ratio']:.3f}x")
    if auto.get("measured_ratio") is not None:
        ratios.append(f"measured {auto['measured_ratio']:.3f}x")
    if ratios:
        parts.append(", ".join(ratios) + " against no offloading")
    memory = auto.get("memory_reason")
    if memory and memory not in parts[0]:
        parts.append(memory)
    return "auto: " + "; ".join(p for p in parts if p) + ". "


def stats_summary(stats: OffloadStats) -> str:
    """One line: sent, kept by reason (non-zero only), host pool."""
    kept = ", ".join(f"{k} {format_bytes(v)}" for k, v in stats.bytes_kept.items() if v)
    auto = _auto_text(stats.auto)
    packed = ""
    if stats.compress_bytes_before:
        packed = (
            f" (fp8: {format_bytes(stats.compress_bytes_before)} compressed to "
            f"{format_bytes(stats.compress_bytes_after)}, ratio "
            f"{stats.compress_bytes_after / stats.compress_bytes_before:.2f})"
        )
    freed = (
        f" (freed {format_bytes(stats.bytes_released)} on the device)"
        if not stats.synchronous
        else " to host memory"
    )
    text = auto + (
        f"offloaded {format_bytes(stats.bytes_offloaded)}{packed}{freed} in "
        f"{sum(1 for la in stats.layers if la.bytes_offloaded)} of {len(stats.layers)} "
        f"layers; kept {kept or 'nothing'}; host pool {format_bytes(stats.host_pool_bytes)} "
        f"in use, {format_bytes(stats.host_pool_reserved_bytes)} reserved"
    )
    text += _recomputed_text(stats)
    return text + (f". {SYNCHRONOUS[0].upper()}{SYNCHRONOUS[1:]}." if stats.synchronous else "")


def _recomputed_text(stats: OffloadStats) -> str:
    n = sum(1 for la in stats.layers if la.recomputed)
    if not n:
        return ""
    return f"; {n} layer calls recomputed (inputs offloaded: Note [recomputed calls])"


def _console(console: Any) -> Any:
    if console is None:
        from rich.console import Console

        console = Console()
    return console


def render_stats(stats: OffloadStats, console: Any = None) -> None:
    """Print the table, its legend and the summary of ``stats``."""
    console = _console(console)
    console.print(layer_table(stats, "offload: saved tensors of the last forward"))
    console.print(legend(stats), style="dim")
    console.print(stats_summary(stats))


def _rate(gbps: float) -> str:
    return f"{gbps:.1f}" if gbps >= 1 else f"{gbps:.3f}"


def _gib(n: Any) -> str:
    return format_bytes(n)


def profile_lines(p: MemoryProfile) -> list[str]:
    """The sentences under a profile's table (memory, time, copies, host), without the
    verdict."""
    lines = []
    if p.memory_source == "cuda_allocator":
        lines.append(
            f"device memory (torch.cuda max_memory_allocated, max over {p.steps} steps): "
            f"peak {_gib(p.peak_allocated_without)} without offloading, "
            f"{_gib(p.peak_allocated_with)} with; reserved {_gib(p.peak_reserved_without)} "
            f"-> {_gib(p.peak_reserved_with)}; activations (peak minus allocated before "
            f"the step) {_gib(p.activation_bytes_without)} -> "
            f"{_gib(p.activation_bytes_with)}."
        )
    else:
        lines.append(
            f"device memory: none to save on {p.device}; the offloader released "
            f"{_gib(p.bytes_saved)} of the {_gib(p.activation_bytes_without)} a step "
            f"saves for backward (weights excluded) after copying them to host memory."
        )
    lines.append(
        f"step time (median of {p.steps} after {p.warmup} warm-up, forward + backward): "
        f"{p.step_ms_without:.2f} ms without, {p.step_ms_with:.2f} ms with "
        f"(x{p.time_ratio:.3f})."
    )
    copy_s, stall_s = p.copy_seconds, p.stall_seconds
    if copy_s is not None:
        parts = [f"copies {copy_s * 1e3:.2f} ms"]
        if p.d2h_gbps is not None:
            parts.append(f"D2H {_rate(p.d2h_gbps)} GB/s")
        if p.h2d_gbps is not None:
            parts.append(f"H2D {_rate(p.h2d_gbps)} GB/s")
        parts.append(f"stall {(stall_s or 0.0) * 1e3:.2f} ms")
        if p.link_d2h_gbps is not None and p.link_h2d_gbps is not None:
            parts.append(
                f"link (256 MiB pinned memcpy) {p.link_d2h_gbps:.1f} / "
                f"{p.link_h2d_gbps:.1f} GB/s D2H / H2D"
            )
        lines.append("; ".join(parts) + ".")
    lines.append(
        f"host: pool {_gib(p.host_pool_reserved_bytes)} reserved"
        f"{' (pinned)' if p.host_pinned else ''}; process RSS {_gib(p.rss_bytes_without)} "
        f"after the steps without offloading, {_gib(p.rss_bytes_with)} after those with."
    )
    return lines


def render_profile(p: MemoryProfile, console: Any = None) -> None:
    """Print a profile: per-layer table, legend, totals and the verdict."""
    console = _console(console)
    console.print(
        layer_table(p.stats, f"offload profile on {p.device}: last measured step with offloading")
    )
    console.print(legend(p.stats), style="dim")
    for line in profile_lines(p):
        console.print(line)
    console.print(p.verdict(), style="bold")
