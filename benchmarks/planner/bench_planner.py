"""The planner (``offload.plan``) on "ref-8L": does the plan it chooses meet a memory
budget at the least step time? Every single-lever configuration, then the planner's plan
for four budgets, predicted and measured, against its targets (a memory budget met at the
least step time).

Command (one CUDA GPU; about a minute on an H200, a few GiB of pinned host memory)::

    PYTHONPATH=. python3 benchmarks/planner/bench_planner.py --out benchmarks/results/planner.json

With offloaded layers compressed (``compress="fp8"`` for ``offload.plan``, the plans
and the ``offload k`` rows)::

    PYTHONPATH=. python3 benchmarks/planner/bench_planner.py --compress fp8 --out /tmp/planner_fp8.json

CPU smoke run (tiny sizes; checks only that the script runs end to end: ``offload.plan``
needs CUDA, so it is skipped and the plans are chosen with ``offload._planner.search.optimize``
on a synthetic :class:`offload.PlanCosts`; CUDA-only columns print n/a)::

    PYTHONPATH=. python3 benchmarks/planner/bench_planner.py --quick --device cpu --out /tmp/p.json

Model: ``offload.models.ReferenceModel(8, 4096, 32, 14336)`` (the "ref-8L" of
docs/performance.md: Llama-style layers, fused QKV, causal SDPA, SwiGLU MLP, no RoPE),
bf16 weights, seed 0; ``--quick``: ``ReferenceModel(8, 64, 4, 128)``. A step is
``model.loss(x).backward()`` (no optimizer step) on a fresh ``x = torch.randn(1, 4096,
4096)`` (``--quick``: ``(1, 32, 64)``) bf16 that does not require grad, drawn inside the
step (its bytes are in every row's peak alike). Gradients are never zeroed: they
accumulate across all steps of the run, as they do inside ``offload.plan``.

Measuring (the semantics of ``offload._planner.verify.measure_step``): per configuration ``--warmup``
unmeasured steps, then ``--steps`` timed steps; before each step a device
synchronisation, ``memory_allocated()`` ("before": weights, gradients) and
``reset_peak_memory_stats()``; CUDA events around the step (``perf_counter`` on the CPU).

* ``step ms``: median of the timed steps' device time; every raw time is in the JSON.
* ``x none``: step ms / step ms of ``no lever`` measured in this run (step 2 below).
* ``act peak``: activation peak = the largest over the timed steps of
  ``max_memory_allocated()`` during the step minus ``memory_allocated()`` before it (the
  planner's memory figure and what its budget refers to). GiB = 2^30 bytes (two
  decimals; smaller values in MiB / KiB).

Steps of the run:

1. Single-lever configurations, each applied with ``offload.Plan(model.layers,
   levers).apply(model)`` and removed after: ``no lever``; ``offload k`` for k = 1..7
   (``["offload"] * k + ["keep"] * (8 - k)``; an ``ActivationOffloader`` over the first
   k layers, entered around the model's forward; ``--compress`` applies); ``checkpoint
   k`` for k = 1..8 (full recompute of the first k layers, non-reentrant
   ``torch.utils.checkpoint``); ``checkpoint_offload k`` for k = 1..7 (the same, with
   the inputs the checkpoint saves offloaded); ``selective all`` (selective recompute of every layer:
   outputs of matrix products and attention kept, the rest recomputed).
2. ``offload.plan(step, model.layers, budget=1.0, model=model, steps=--plan-steps,
   warmup=--plan-warmup, compress=--compress)``, once: it measures its own
   configurations and returns ``plan.costs`` (:class:`offload.PlanCosts`, the cost
   model). The plans for the budgets below are chosen from those costs with
   ``plan.replan(budget, step_fn=step, model=model)``: the measuring happens once, and
   each budget's choice is checked as ``offload.plan(verify=True)`` checks it (the
   fastest predicted plans applied in turn until one's measured peak fits, then up to
   three more predicted within 3 % of it measured; when one of those fits too, every
   plan that fits is measured again in two rounds of alternating order and the fastest
   pooled median kept; every check is in the JSON and printed).
3. For each budget: 75%, 50%, 25% of ``costs.activation_bytes`` (the planner's own
   measured activation peak without levers), and ``act peak`` of ``checkpoint 8``
   (checkpoint every layer) from step 1: the chosen plan is applied and measured.

Columns of the single-lever table (also):

* ``pred ms`` / ``pred peak``: ``costs.seconds(levers)`` / ``costs.memory(levers)``,
  the planner's predictions for that configuration (from step 2);
* ``t err`` / ``m err``: predicted / measured - 1, of the time and of the activation peak;
* ``D2H / step``: bytes offloaded in the last timed step (``offloader.stats``).

Columns of the plans table:

* ``budget``: its name and bytes; ``levers``: one letter per layer, ``o`` offload, ``S``
  selective_offload, ``s`` selective, ``c`` checkpoint, ``C`` checkpoint_offload, ``i``
  selective_offload_inputs, ``.`` keep, then the counts;
* ``bytes``: the budget in bytes;
* ``pred ms``, ``pred peak``: ``plan.predicted_seconds``, ``plan.predicted_bytes``;
  ``step ms``, ``x none``, ``act peak``: measured as above; ``t err``, ``m err``:
  predicted / measured - 1;
* ``fits``: ``act peak`` <= the budget.

Columns of the targets table:

* ``best single lever``: the fastest (by step ms) of the configurations of step 1 (no
  lever included) whose ``act peak`` is within the budget, and its ``x none``;
* ``plan / best``: plan step ms / best single lever step ms; target <= 1.02 ("never more
  than 2% slower than the best single lever that fits");
* ``A/B x none``: the plan against ``no lever`` measured in alternating blocks (step 4);
* ``target``: 75%: plan ``A/B x none`` (``x none`` with ``--ab-rounds 0``) <= 1.02;
  50%: <= 1.07; 25%: <= 1.20; checkpoint every layer's memory: plan step ms <
  ``checkpoint 8`` step ms;
* ``verdict``: ``pass`` when the plan fits, ``plan / best`` meets its target and the
  budget's target is met; ``FAIL`` otherwise (``n/a`` parts, as on the CPU, are left out);
  ``FAIL (no plan)`` when ``optimize`` finds no plan within the budget.

4. For the three fractional budgets, the plan and ``no lever`` again, in alternating
   blocks: ``--ab-rounds`` rounds (default 4), each a block of each (the first of a round
   alternating: no lever first in even rounds), a block being ``--ab-warmup``
   unmeasured steps (default 4: a plan applied again makes a new offloader, whose first
   steps allocate its pinned host memory) then ``--ab-steps`` timed steps (default 5),
   with one ``free_cached`` before the first block only. ``A/B x none`` = median of the plan's pooled timed steps / median
   of no lever's. Why: on the H200 the step time of one configuration moves by up to
   +20 % for two or three steps about every ten steps (every configuration, offloaded
   or not, with or without emptying the allocator's cache first: a device-side cycle,
   probably power management), and by about 1 % between two runs of the same
   configuration a minute apart; configurations measured one after the other in step
   1 differ by that much for no reason of their own, which is the size of the 75 %
   target's margin. Alternating blocks give both sides the same conditions.

Last, ``no lever`` and ``checkpoint 8`` are measured again (JSON ``none_again``,
``checkpoint_again``), to show how far the device's speed drifted during the run
(printed as ``drift``). Every configuration, single lever or plan, is measured from the
same state: garbage collected and the caching allocator emptied first
(``_common.free_cached``).

``--levers all`` lets ``offload.plan`` use every lever (``LEVERS``); the default is
``DEFAULT_LEVERS``, as ``offload.plan``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import offload
from benchmarks._common import (
    GIB,
    LEVER_LETTERS,
    Timer,
    environment,
    free_cached,
    median,
    synchronize,
    write_json,
)
from offload import DEFAULT_LEVERS, LEVERS, Plan, PlanCosts
from offload._planner.search import optimize
from offload.models import ReferenceModel
from offload.profiling import format_bytes

DTYPE = torch.bfloat16
#: budget name -> (fraction of the no-lever activation peak or None, largest ``x none``)
BUDGETS: dict[str, tuple[float | None, float | None]] = {
    "75%": (0.75, 1.02),
    "50%": (0.50, 1.07),
    "25%": (0.25, 1.20),
    "ckpt every layer": (None, None),  # target: faster than checkpoint every layer
}
VS_BEST = 1.02  # never more than 2% slower than the best single lever that fits


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the benchmarked model."""

    layers: int = 8
    hidden: int = 4096
    heads: int = 32
    ffn: int = 14336
    seq: int = 4096
    batch: int = 1


QUICK = ModelConfig(layers=8, hidden=64, heads=4, ffn=128, seq=32, batch=1)


# --------------------------------------------------------------------------------------
# measuring


def measure(
    step: Callable[[], None], device: torch.device, steps: int, warmup: int
) -> dict[str, Any]:
    """``offload._planner.verify.measure_step``'s semantics, keeping every raw value: median step ms
    (CUDA events) and the largest activation peak over the timed steps."""
    cuda = device.type == "cuda"
    timer = Timer(device)
    times: list[float] = []
    peaks: list[int] = []
    for i in range(warmup + steps):
        synchronize(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = timer.mark()
        step()
        end = timer.mark()
        synchronize(device)
        if i >= warmup:
            times.append(timer.elapsed_ms(start, end))
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated(device) - before)
    return {
        "times_ms": times,
        "peaks_bytes": peaks if cuda else None,
        "step_ms_median": median(times),
        "peak_bytes": max(peaks) if peaks else None,
    }


def measure_levers(
    model: ReferenceModel,
    levers: Sequence[str] | Plan,
    step: Callable[[], None],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Apply ``Plan(model.layers, levers)`` (or the given plan), measure the step, remove
    the plan."""
    if not isinstance(levers, Plan):
        levers = Plan(
            model.layers, levers, compress=args.compress, min_tensor_bytes=args.min_tensor_bytes
        )
    free_cached(args.device)  # every row starts from the same state, whatever ran before it
    p = levers.apply(model)
    try:
        row = measure(step, args.device, args.steps, args.warmup)
        row["bytes_d2h"] = p.offloader.stats.bytes_offloaded if p.offloader is not None else 0
    finally:
        p.remove()
    free_cached(args.device)
    return row


def interleaved(
    model: ReferenceModel,
    plan: Plan,
    step: Callable[[], None],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``no lever`` and ``plan`` measured in alternating blocks (step 4 of the module
    docstring): ``--ab-rounds`` rounds of two blocks, the first of each round
    alternating (ABBA...), each block ``--ab-warmup`` unmeasured and ``--ab-steps``
    timed steps; one ``free_cached`` before the first block only. The ratio is the median of
    the plan's pooled steps over the median of no lever's."""
    none = Plan(model.layers, ["keep"] * len(model.layers))
    free_cached(args.device)
    times: dict[str, list[float]] = {"none": [], "plan": []}
    for r in range(args.ab_rounds):
        order = [("none", none), ("plan", plan)]
        for name, p in order if r % 2 == 0 else order[::-1]:
            p.apply(model)
            try:
                block = measure(step, args.device, args.ab_steps, args.ab_warmup)
                times[name] += block["times_ms"]
            finally:
                p.remove()
    none_ms, plan_ms = median(times["none"]), median(times["plan"])
    return {
        "none_times_ms": times["none"],
        "plan_times_ms": times["plan"],
        "none_ms_median": none_ms,
        "plan_ms_median": plan_ms,
        "ratio": plan_ms / none_ms,
    }


def single_lever_configs(L: int) -> list[tuple[str, list[str]]]:
    """Step 1's configurations: (name, levers)."""
    out = [("no lever", ["keep"] * L)]
    out += [(f"offload {k}", ["offload"] * k + ["keep"] * (L - k)) for k in range(1, L)]
    out += [(f"checkpoint {k}", ["checkpoint"] * k + ["keep"] * (L - k)) for k in range(1, L + 1)]
    out += [
        (f"checkpoint_offload {k}", ["checkpoint_offload"] * k + ["keep"] * (L - k))
        for k in range(1, L)  # the last layer cannot offload
    ]
    out.append(("selective all", ["selective"] * L))
    return out


def synthetic_costs(L: int, cfg: ModelConfig, none_ms: float) -> PlanCosts:
    """A cost model for the CPU smoke run (``offload.plan`` needs CUDA): layers of equal
    cost sharing the measured no-lever step, a link that takes 1.5 forwards per layer."""
    step_s = none_ms / 1e3
    f = step_s / (3 * L)
    size = cfg.batch * cfg.seq * cfg.hidden * 2 * 12  # about 12 hidden-sized bf16 tensors
    bps = size / (1.5 * f)
    return PlanCosts(
        forward_s=[f] * L,
        backward_s=[2 * f] * L,
        saved_bytes=[size] * L,
        selective_kept=0.6,
        checkpoint_kept=0.1,
        selective_s=[0.3 * f] * L,
        checkpoint_s=[f] * L,
        d2h_bps=bps,
        h2d_bps=bps,
        workspace_bytes=size // 4,
        prefetch_bytes=size // 4,
        step_s=step_s,
    )


# --------------------------------------------------------------------------------------
# analysis


def _err(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0


def code(levers: Sequence[str]) -> str:
    """``ooocc...`` then the counts: ``3 offload, 2 checkpoint, 3 keep``."""
    counts = ", ".join(
        f"{n} {name}" for name in LEVERS if (n := sum(1 for x in levers if x == name))
    )
    return "".join(LEVER_LETTERS[x] for x in levers) + f" ({counts})"


def add_predictions(rows: list[dict[str, Any]], costs: PlanCosts) -> None:
    """The planner's predictions and their errors for the single-lever rows."""
    none_ms = rows[0]["step_ms_median"]
    for row in rows:
        row["ratio_to_none"] = row["step_ms_median"] / none_ms
        row["predicted_ms"] = costs.seconds(row["levers"]) * 1e3
        row["predicted_bytes"] = costs.memory(row["levers"])
        row["time_error"] = _err(row["predicted_ms"], row["step_ms_median"])
        row["memory_error"] = _err(row["predicted_bytes"], row["peak_bytes"])


def best_single(rows: list[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """The fastest single-lever row whose measured peak is within ``budget``."""
    fits = [r for r in rows if r["peak_bytes"] is not None and r["peak_bytes"] <= budget]
    if not fits:
        return None
    best = min(fits, key=lambda r: r["step_ms_median"])
    return {k: best[k] for k in ("name", "step_ms_median", "ratio_to_none", "peak_bytes")}


def judge(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Fill the budget row's checks against the targets and its verdict."""
    measured = row.get("measured")
    checks: dict[str, bool | None] = {"fits": None, "vs_best": None, "target": None}
    if measured is None:  # no plan fits (optimize raised)
        row["checks"], row["verdict"] = checks, "FAIL (no plan)"
        return
    ms, peak = measured["step_ms_median"], measured["peak_bytes"]
    if peak is not None:
        checks["fits"] = peak <= row["budget_bytes"]
    best = row["best_single"]
    if best is not None:
        row["ratio_to_best"] = ms / best["step_ms_median"]
        checks["vs_best"] = row["ratio_to_best"] <= VS_BEST
    else:
        row["ratio_to_best"] = None
    if row["target_ratio"] is not None:
        ab = row.get("ab")
        ratio = ab["ratio"] if ab is not None else row["ratio_to_none"]
        checks["target"] = ratio <= row["target_ratio"]
    else:
        ckpt = next(r for r in rows if r["name"] == f"checkpoint {len(row['levers'])}")
        row["target_ms"] = ckpt["step_ms_median"]
        checks["target"] = ms < ckpt["step_ms_median"]
    known = [v for v in checks.values() if v is not None]
    row["checks"] = checks
    row["verdict"] = "n/a" if not known else ("pass" if all(known) else "FAIL")


# --------------------------------------------------------------------------------------
# report


def _mem(n: float | None) -> str:
    """Bytes: ``12.34 GiB`` from 1 GiB up (two decimals: budgets are compared), else
    ``format_bytes``."""
    if n is None:
        return "n/a"
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else format_bytes(n)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _ok(x: bool | None) -> str:
    return "n/a" if x is None else ("yes" if x else "NO")


def print_report(result: dict[str, Any]) -> None:
    """Header, cost model, and the three tables, with rich."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    env, s, cfg = result["environment"], result["settings"], result["settings"]["model"]
    where = f"{env['gpu']} ({env['device']})" if "gpu" in env else env["device"]
    console.print(
        f"[bold]bench_planner[/bold]: {s['model_name']} (hidden {cfg['hidden']}, heads "
        f"{cfg['heads']}, ffn {cfg['ffn']}, {cfg['layers']} layers, seq {cfg['seq']}, batch "
        f"{cfg['batch']}, bf16) on {where}, torch {env['torch']} (CUDA "
        f"{env['torch_cuda'] or 'n/a'}), offload {env['offload']}; compress {s['compress']}"
    )
    pl = result["planner"]
    c = pl["plan"]["costs"]
    L = len(c["forward_s"])
    link = c["link_bytes"] or c["saved_bytes"]
    console.print(
        f"cost model ({pl['source']}, {pl['wall_s']:.1f} s): per layer F "
        f"{median(c['forward_s']) * 1e3:.2f} ms, B {median(c['backward_s']) * 1e3:.2f} ms, S "
        f"{format_bytes(median(c['saved_bytes']))} (link {format_bytes(median(link))}) "
        f"(medians of {L}); rho_sel {c['selective_kept']:.3f}, rho_ckpt "
        f"{c['checkpoint_kept']:.3f}, W {format_bytes(c['workspace_bytes'])}, P "
        f"{format_bytes(c['prefetch_bytes'])}; link D2H {c['d2h_bps'] / 1e9:.1f} GB/s, H2D "
        f"{c['h2d_bps'] / 1e9:.1f} GB/s; no-lever step "
        f"{(c['step_s'] or 0) * 1e3:.1f} ms, activation peak {_mem(pl['activation_bytes'])}"
    )

    table = Table(title="single-lever configurations (step 1)", title_justify="left")
    for col in (
        "config",
        "step ms",
        "x none",
        "act peak",
        "pred ms",
        "t err",
        "pred peak",
        "m err",
        "D2H / step",
    ):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in result["single"]:
        table.add_row(
            r["name"],
            f"{r['step_ms_median']:.1f}",
            f"{r['ratio_to_none']:.3f}",
            _mem(r["peak_bytes"]),
            f"{r['predicted_ms']:.1f}",
            _pct(r["time_error"]),
            _mem(r["predicted_bytes"]),
            _pct(r["memory_error"]),
            format_bytes(r["bytes_d2h"]) if r["bytes_d2h"] else "-",
        )
    console.print(table)

    table = Table(title="the planner's plans: predicted and measured", title_justify="left")
    for col in (
        "budget",
        "bytes",
        "levers",
        "pred ms",
        "step ms",
        "x none",
        "t err",
        "pred peak",
        "act peak",
        "m err",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("budget", "levers") else "right")
    for r in result["budgets"]:
        m = r.get("measured")
        if m is None:
            table.add_row(r["name"], _mem(r["budget_bytes"]), "no plan (below)")
            continue
        table.add_row(
            r["name"],
            _mem(r["budget_bytes"]),
            code(r["levers"]),
            f"{r['predicted_ms']:.1f}",
            f"{m['step_ms_median']:.1f}",
            f"{r['ratio_to_none']:.3f}",
            _pct(r["time_error"]),
            _mem(r["predicted_bytes"]),
            _mem(m["peak_bytes"]),
            _pct(r["memory_error"]),
            _ok(r["checks"]["fits"]),
        )
    console.print(table)
    for r in result["budgets"]:
        if r.get("measured") is None:
            console.print(f"{r['name']}: no plan: {r['error']}")

    table = Table(title="against the targets", title_justify="left")
    for col in (
        "budget",
        "plan x none",
        "A/B x none",
        "best single lever",
        "its x none",
        f"plan / best (<= {VS_BEST})",
        "target",
        "verdict",
    ):
        table.add_column(col, justify="left" if col in ("budget", "best single lever") else "right")
    for r in result["budgets"]:
        best = r["best_single"]
        checks = r["checks"]
        ab = r.get("ab")
        if r["target_ratio"] is not None:
            target = f"{'A/B ' if ab else ''}x none <= {r['target_ratio']:.2f}"
        else:
            target = f"< {r['target_ms']:.1f} ms" if "target_ms" in r else "< checkpoint all"
        target += f" {_ok(checks['target'])}" if r.get("measured") else ""
        vs_best = "n/a"
        if r.get("ratio_to_best") is not None:
            vs_best = f"{r['ratio_to_best']:.3f} {_ok(checks['vs_best'])}"
        table.add_row(
            r["name"],
            f"{r['ratio_to_none']:.3f}" if r.get("measured") else "-",
            f"{ab['ratio']:.3f}" if ab else "-",
            "none fits" if best is None else best["name"],
            "-" if best is None else f"{best['ratio_to_none']:.3f}",
            vs_best,
            target,
            r["verdict"],
        )
    console.print(table)
    again, none_ms = result["none_again"]["step_ms_median"], result["single"][0]["step_ms_median"]
    console.print(
        f"no lever again at the end: {again:.1f} ms (drift {_pct(again / none_ms - 1)} from "
        f"{none_ms:.1f} ms), act peak {_mem(result['none_again']['peak_bytes'])}"
    )
    L = len(result["single"][0]["levers"])
    ckpt_ms = next(r for r in result["single"] if r["name"] == f"checkpoint {L}")["step_ms_median"]
    again = result["checkpoint_again"]["step_ms_median"]
    console.print(
        f"checkpoint {L} again at the end: {again:.1f} ms (drift {_pct(again / ckpt_ms - 1)} "
        f"from {ckpt_ms:.1f} ms)"
    )
    clock = "CUDA events" if env["device"].startswith("cuda") else "perf_counter"
    console.print(
        f"step ms: median of {s['steps']} timed steps after {s['warmup']} warm-up ({clock}); "
        "act peak: peak allocated during a step minus allocated before it (weights + "
        "gradients); x none: ratio to 'no lever' of step 1; t err / m err: predicted / "
        "measured - 1; levers: o offload, S selective_offload, s selective, c checkpoint, C checkpoint_offload, i selective_offload_inputs, . keep. Definitions: "
        "header of benchmarks/planner/bench_planner.py."
    )
    if not env["device"].startswith("cuda"):
        console.print(
            "CPU smoke run: offload.plan needs CUDA, so the cost model is synthetic and no "
            "memory is measured; the numbers mean nothing.",
            style="dim",
        )


# --------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=9, help="timed steps per configuration (>= 5)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="warm-up steps per configuration (>= 1; a configuration with an offloader "
        "makes a new one, whose first steps allocate its pinned host memory)",
    )
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=4,
        help="rounds of the interleaved no lever / plan measurement of each budget (0: none)",
    )
    parser.add_argument(
        "--ab-steps", type=int, default=5, help="timed steps per block of those rounds (>= 1)"
    )
    parser.add_argument(
        "--ab-warmup",
        type=int,
        default=4,
        help="unmeasured steps at the start of each block (>= 1): a plan applied again "
        "makes a new offloader, whose first steps allocate its pinned host memory",
    )
    parser.add_argument("--plan-steps", type=int, default=3, help="steps= of offload.plan")
    parser.add_argument("--plan-warmup", type=int, default=1, help="warmup= of offload.plan")
    parser.add_argument(
        "--compress",
        choices=["fp8"],
        default=None,
        help="compress= of offload.plan, of the plans and of the 'offload k' rows",
    )
    parser.add_argument(
        "--levers",
        choices=["default", "all"],
        default="default",
        help="levers= of offload.plan: DEFAULT_LEVERS (plan()'s default) or all of LEVERS",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny sizes for a smoke run ({dataclasses.asdict(QUICK)}), min_tensor_bytes=0",
    )
    args = parser.parse_args(argv)
    if args.steps < 5:
        parser.error(f"--steps {args.steps}: at least 5 timed steps")
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: at least 1 (gradients must exist)")
    if args.ab_rounds < 0 or args.ab_steps < 1 or args.ab_warmup < 1:
        parser.error(
            f"--ab-rounds {args.ab_rounds} / --ab-steps {args.ab_steps} / --ab-warmup "
            f"{args.ab_warmup}: rounds >= 0, steps >= 1, warm-up >= 1"
        )
    args.model = QUICK if args.quick else ModelConfig()
    args.allowed = LEVERS if args.levers == "all" else DEFAULT_LEVERS
    args.min_tensor_bytes = 0 if args.quick else 256 * 1024
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu (with --quick)")
    if args.device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device}: only cuda and cpu are supported")
    if args.device.type == "cpu" and not args.quick:
        parser.error("--device cpu is a smoke run: add --quick (ref-8L in bf16 on a CPU is slow)")
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device, cfg = args.device, args.model
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # tiny ops: threads only add contention
    result: dict[str, Any] = {
        "benchmark": "bench_planner",
        "command": [sys.executable, *sys.argv],
        "settings": {
            "model_name": "quick" if args.quick else "ref-8L",
            "model": dataclasses.asdict(cfg),
            "dtype": str(DTYPE),
            "steps": args.steps,
            "warmup": args.warmup,
            "plan_steps": args.plan_steps,
            "plan_warmup": args.plan_warmup,
            "ab_rounds": args.ab_rounds,
            "ab_steps": args.ab_steps,
            "ab_warmup": args.ab_warmup,
            "compress": args.compress,
            "min_tensor_bytes": args.min_tensor_bytes,
            "levers": list(args.allowed),
            "quick": args.quick,
            "vs_best_target": VS_BEST,
            "budgets": {
                k: {"fraction": f, "max_ratio_to_none": t} for k, (f, t) in BUDGETS.items()
            },
        },
        "environment": environment(device),
    }

    torch.manual_seed(0)
    model = ReferenceModel(cfg.layers, cfg.hidden, cfg.heads, cfg.ffn, device=device, dtype=DTYPE)
    L = cfg.layers

    def step() -> None:
        x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, device=device, dtype=DTYPE)
        model.loss(x).backward()

    # step 1: every single-lever configuration
    rows: list[dict[str, Any]] = []
    for name, levers in single_lever_configs(L):
        rows.append({"name": name, "levers": levers} | measure_levers(model, levers, step, args))
        print(f"  {name}: {rows[-1]['step_ms_median']:.1f} ms", file=sys.stderr, flush=True)
    result["single"] = rows

    # step 2: the cost model, measured once
    start = time.perf_counter()
    if device.type == "cuda":
        base = offload.plan(
            step,
            model.layers,
            budget=1.0,
            model=model,
            levers=args.allowed,
            compress=args.compress,
            min_tensor_bytes=args.min_tensor_bytes,
            steps=args.plan_steps,
            warmup=args.plan_warmup,
        )
        source = "offload.plan"
    else:
        costs = synthetic_costs(L, cfg, rows[0]["step_ms_median"])
        base = Plan(
            model.layers,
            optimize(costs, costs.memory(["keep"] * L), args.allowed),
            costs=costs,
            compress=args.compress,
            min_tensor_bytes=args.min_tensor_bytes,
        )
        source = "synthetic PlanCosts (CPU)"
    wall = time.perf_counter() - start
    free_cached(device)
    costs = base.costs
    assert costs is not None
    reference = costs.activation_bytes
    if reference is None:  # synthetic costs: the model's own no-lever peak
        reference = costs.memory(["keep"] * L)
    result["planner"] = {
        "source": source,
        "wall_s": wall,
        "activation_bytes": reference,
        "plan": base.to_dict(),
    }
    add_predictions(rows, costs)

    # step 3: the plan of each budget, applied and measured
    ckpt_all = next(r for r in rows if r["name"] == f"checkpoint {L}")
    budgets: list[dict[str, Any]] = []
    for name, (fraction, target) in BUDGETS.items():
        if fraction is not None:
            limit = fraction * reference
        elif ckpt_all["peak_bytes"] is not None:
            limit = float(ckpt_all["peak_bytes"])
        else:  # CPU: no measured peak; the model's prediction stands in
            limit = costs.memory(["checkpoint"] * L)
        row: dict[str, Any] = {
            "name": name,
            "fraction": fraction,
            "budget_bytes": limit,
            "target_ratio": target,
            "best_single": best_single(rows, limit),
        }
        try:
            if device.type == "cuda":  # as offload.plan(verify=True) chooses
                chosen = base.replan(int(limit), step_fn=step, model=model, steps=args.plan_steps)
                levers = chosen.levers
                row["checks"] = chosen.measured.get("checks", [])
                for ch in row["checks"]:
                    print(
                        f"  {name} checked {code(ch['levers'])}: predicted "
                        f"{ch['predicted_seconds'] * 1e3:.1f} ms, measured "
                        f"{ch['measured_seconds'] * 1e3:.1f} ms, "
                        f"{ch['measured_bytes'] / 2**30:.2f} GiB"
                        f"{'' if ch['fits'] else ' (over)'}{' rival' if ch['rival'] else ''}"
                        + (
                            f", pooled {ch['pooled_seconds'] * 1e3:.1f} ms"
                            if "pooled_seconds" in ch
                            else ""
                        ),
                        file=sys.stderr,
                    )
            else:
                levers = optimize(costs, limit, args.allowed)
        except ValueError as exc:
            row |= {"levers": None, "error": str(exc), "measured": None}
            budgets.append(row)
            judge(row, rows)
            continue
        p = Plan(
            model.layers,
            levers,
            costs=costs,
            budget_bytes=limit,
            compress=args.compress,
            min_tensor_bytes=args.min_tensor_bytes,
        )
        measured = measure_levers(model, p, step, args)
        row |= {
            "levers": levers,
            "predicted_ms": p.predicted_seconds * 1e3,  # type: ignore[operator]
            "predicted_bytes": p.predicted_bytes,
            "measured": measured,
            "ratio_to_none": measured["step_ms_median"] / rows[0]["step_ms_median"],
            "plan": p.to_dict(),
        }
        row["time_error"] = _err(row["predicted_ms"], measured["step_ms_median"])
        row["memory_error"] = _err(row["predicted_bytes"], measured["peak_bytes"])
        if args.ab_rounds and fraction is not None:
            row["ab"] = interleaved(model, p, step, args)
        judge(row, rows)
        budgets.append(row)
        print(f"  budget {name}: {code(levers)}", file=sys.stderr, flush=True)
    if device.type != "cuda":  # synthetic costs, no memory: the verdicts mean nothing
        for row in budgets:
            row["verdict"] += " (cpu)"
    result["budgets"] = budgets
    result["verdicts"] = {r["name"]: r["verdict"] for r in budgets}
    result["none_again"] = measure_levers(model, ["keep"] * L, step, args)
    result["checkpoint_again"] = measure_levers(model, ["checkpoint"] * L, step, args)

    print_report(result)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
