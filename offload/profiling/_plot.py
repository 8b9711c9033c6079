"""Plots (matplotlib): the timeline of a :class:`~offload.MemoryProfile`.

The only module that imports matplotlib, and only when a plot is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from offload.profiling._data import MemoryProfile

__all__ = ["PLOT_HINT", "save_profile_plot"]

PLOT_HINT = 'MemoryProfile.plot needs matplotlib: pip install "offload[plot]"'


def save_profile_plot(p: MemoryProfile, path: Any) -> None:
    """Write the figure of :meth:`offload.MemoryProfile.plot` to ``path``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the profile has no timeline.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(PLOT_HINT) from exc
    if p.timeline is None:
        raise ValueError("this profile has no timeline to plot")
    _draw(p, Figure, Patch).savefig(path, dpi=110)


def _draw(p: MemoryProfile, Figure: Any, Patch: Any) -> Any:
    """The figure of :meth:`MemoryProfile.plot`."""
    import matplotlib

    tl = p.timeline
    assert tl is not None  # the caller checked: a profile without one has no plot
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
