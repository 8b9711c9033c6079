"""Text rendering (rich) of :class:`offload.Plan`: its table, the measured configurations,
the cost model's errors and a one-line summary (``Plan.table()``, ``summary()``,
``report()``), with the helpers of ``offload/profiling/_render.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offload._core._units import format_bytes
from offload._planner.levers import summary
from offload._planner.model_levers import describe, not_candidates
from offload.profiling._render import _console, short_bytes

if TYPE_CHECKING:  # pragma: no cover
    from offload._planner.costs import PlanCosts
    from offload._planner.plan import Plan

__all__ = [
    "plan_errors_table", "plan_summary", "plan_table", "prediction_errors", "render_plan",
]  # fmt: skip


def plan_table(plan: Plan) -> Any:
    """A :class:`rich.table.Table` of ``plan``: one row per layer (lever, bytes kept
    between forward and backward, bytes sent each way, added backward ms), a total row
    and, when the costs know them, what no lever touches: the head's memory (``H``:
    head, loss and their gradients, on top of what the layers keep) and the workspace
    of a layer's forward or backward (``W``)."""
    from rich.table import Table

    table = Table(title="offload plan", title_justify="left")
    for name in ("layer", "lever", "kept", "link", "+ms"):
        table.add_column(name, justify="left" if name == "lever" else "right")
    c = plan.costs
    kept_total = link_total = extra_total = 0.0
    for i, lever in enumerate(plan.levers):
        if c is None:
            table.add_row(str(i), lever, "-", "-", "-")
            continue
        kept = c.resident(i, lever)
        link = c.sent(i, lever)
        extra = c.extra_seconds(i, lever)
        kept_total += kept
        link_total += link
        extra_total += extra
        table.add_row(
            str(i),
            lever,
            format_bytes(kept),
            format_bytes(link) if link else "-",
            f"{extra * 1e3:.2f}" if extra else "-",
        )
    if c is not None:
        table.add_row(
            "all",
            summary(plan.levers),
            format_bytes(kept_total),
            format_bytes(link_total),
            f"{extra_total * 1e3:.2f}",
            style="bold",
        )
        untouched = "(no lever)"
        if c.head_bytes is not None:
            table.add_row("head", untouched, format_bytes(c.head_bytes), "-", "-", style="dim")
        name = "workspace" if c.head_bytes is not None else "workspace+head"
        table.add_row(name, untouched, format_bytes(c.workspace_bytes), "-", "-", style="dim")
    for lever in plan.model_levers:
        table.add_row("model", lever, "-", "-", "-", style="bold")
    return table


def plan_summary(plan: Plan) -> str:
    """Predicted time and peak against the step without levers and the budget."""
    c = plan.costs
    outside = ""
    if plan.model_levers:
        outside = f"; outside the layers: {describe(plan.model_levers)}"
    why = not_candidates(plan.measured)
    if c is None:
        return f"plan: {summary(plan.levers)}{outside} (chosen by hand: no predictions)"
    t, m = c.seconds(plan.levers), c.memory(plan.levers)
    base = plan._unlevered or c  # the step without any lever
    keep = ["keep"] * c.num_layers
    base_t = base.step_s if base.step_s is not None else base.raw_seconds(keep)
    base_m = base.memory(keep)
    budget = "" if plan.budget_bytes is None else f" (budget {format_bytes(plan.budget_bytes)})"
    return (
        f"plan: {summary(plan.levers)}{outside}{why}; predicted step {t * 1e3:.1f} ms "
        f"({t / base_t:.3f}x the step without levers, {base_t * 1e3:.1f} ms); predicted "
        f"activation peak {format_bytes(m)} of {format_bytes(base_m)} without levers{budget}"
    )


def render_plan(plan: Plan, console: Any = None) -> None:
    """Print the table, the measured configurations (when measured) and the summary."""
    console = _console(console)
    console.print(plan_table(plan))
    rows = plan.measured.get("configs")
    if rows:
        base = rows.get("none", {}).get("seconds")
        parts = []
        for name, row in rows.items():
            ratio = f" {row['seconds'] / base:.2f}x" if base else ""
            parts.append(f"{name}{ratio} {format_bytes(row['peak_bytes'])}")
        console.print("measured, every layer: " + "; ".join(parts), style="dim")
    errors = plan.prediction_errors()
    if errors:
        console.print(plan_errors_table(errors))
    console.print(plan_summary(plan))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def plan_errors_table(rows: list[dict[str, Any]]) -> Any:
    """A :class:`rich.table.Table` of :meth:`offload.Plan.prediction_errors`: per
    measured configuration, predicted and measured step ms and activation peak, and
    the errors (predicted / measured - 1; ``fit`` where the model was fitted to it)."""
    from rich.table import Table

    table = Table(
        title="the cost model against the steps measured",
        title_justify="left",
        caption="err: predicted / measured - 1; *: the model is fitted to this one",
        caption_justify="left",
    )
    for name in ("measured", "levers", "pred ms", "ms", "t err", "pred", "peak", "m err"):
        table.add_column(name, justify="left" if name in ("measured", "levers") else "right")
    for r in rows:
        fitted = r.get("fitted", [])
        table.add_row(
            r["name"],
            summary(r["levers"]),
            f"{r['predicted_seconds'] * 1e3:.1f}",
            f"{r['measured_seconds'] * 1e3:.1f}",
            _pct(r["time_error"]) + ("*" if "seconds" in fitted else ""),
            short_bytes(r["predicted_bytes"]),
            "-" if r["measured_bytes"] is None else short_bytes(r["measured_bytes"]),
            _pct(r["memory_error"]) + ("*" if "bytes" in fitted else ""),
        )
    return table


def prediction_errors(plan: Plan) -> list[dict[str, Any]]:
    """:meth:`offload.Plan.prediction_errors` of ``plan``."""
    if plan.costs is None:
        return []
    # the configurations were measured without model levers: their model's rows
    c = plan._unlevered or plan.costs
    L = c.num_layers
    every = {
        "none": ["keep"] * L,
        "offload": ["offload"] * (L - 1) + ["keep"],
        "selective": ["selective"] * L,
        "checkpoint": ["checkpoint"] * L,
    }
    fitted = {
        "none": ["seconds", "bytes"],
        "offload": ["seconds"] if plan.compress is not None else [],
        "selective": ["seconds", "bytes"],
        "checkpoint": ["seconds", "bytes"],
    }
    rows = []
    for name, got in plan.measured.get("configs", {}).items():
        levers = every.get(name)
        if levers is None:
            continue
        rows.append(
            _error_row(
                "none" if name == "none" else f"all {name}",
                levers,
                c,
                got["seconds"],
                got["peak_bytes"],
            )
            | {"fitted": fitted.get(name, [])}
        )
    c = plan.costs  # the checks measured plans of this plan's model levers
    for check in plan.measured.get("checks", []):
        name = check.get("single")
        kind = "corrected" if check.get("corrected") else "rival" if check["rival"] else "plan"
        label = f"single {name}" if name else kind
        seconds = check.get("pooled_seconds", check["measured_seconds"])
        row = _error_row(
            label,
            check["levers"],
            c,
            seconds,
            check["measured_bytes"],
            check.get("compressed"),
        )
        rows.append(row | {"fitted": []})
    return rows


def _error_row(
    name: str,
    levers: list[str],
    c: PlanCosts,
    seconds: float,
    peak: float | None,
    compressed: list[bool] | None = None,
) -> dict[str, Any]:
    t, m = c.seconds(levers, compressed), c.memory(levers)
    return {
        "name": name,
        "levers": list(levers),
        "predicted_seconds": t,
        "measured_seconds": seconds,
        "time_error": t / seconds - 1.0 if seconds else None,
        "predicted_bytes": m,
        "measured_bytes": peak,
        "memory_error": m / peak - 1.0 if peak else None,
    }
