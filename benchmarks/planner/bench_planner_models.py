"""The planner on real models: each plan verified against no lever in alternating blocks,
beside the best single lever that fits its budget.

Command (one CUDA GPU; about 5 minutes on an H200, a few GiB of pinned host memory)::

    PYTHONPATH=. python3 benchmarks/planner/bench_planner_models.py --out $OUT/planner_llama_h200.json

CPU smoke run (tiny sizes; ``offload.plan`` needs CUDA, so the cost model is synthetic
and the plans unchecked; the numbers mean nothing)::

    PYTHONPATH=. python3 benchmarks/planner/bench_planner_models.py --quick --device cpu --out /tmp/p.json

Cases (``--cases`` picks some by name):

* ``llama-4k``: Hugging Face ``LlamaForCausalLM`` from ``LlamaConfig(hidden_size=2048,
  num_hidden_layers=16, intermediate_size=5632, num_attention_heads=32,
  num_key_value_heads=4, vocab_size=32000)``, SDPA attention, bf16, random weights
  (seed 0), batch 1, seq 4096, ``loss = model(input_ids=t, labels=t).loss`` on fixed
  random tokens. Budgets 50 % and 25 % of the planner's measured activation peak without
  levers, and the peak Hugging Face checkpointing with ``offload_checkpointing()``
  reaches (measured here). Targets: 50 % <= 1.15x, 25 % <= 1.35x.
* ``llama-16k``: the same model at seq 16384; budget 25 %, target <= 1.25x.
* ``ref-8L``: ``offload.models.ReferenceModel(8, 4096, 32, 14336)``, bf16, seq 4096,
  ``model.loss(x)`` on a fixed ``x``; budgets 75 / 50 / 25 %, targets 1.02 / 1.06 / 1.15.
* ``ref-8L-fp8``: the same with ``compress="fp8"`` allowed; budgets 50 / 25 %, target
  25 % <= 1.10.

Per case: ``offload.plan(step, layers, budget=1.0, model=model, compress=...,
verify=False)`` measures the costs once (``plan_s``); each budget's plan is
``base.replan(budget, step_fn=step, model=model)`` (the verification, the single-lever
guarantee included; ``replan_s``). The single-lever configurations
(``offload._planner.search.single_levers`` of the measured costs: nothing, offload all
that hides, selective, checkpoint, checkpoint with offloaded inputs; for the Llama cases
also Hugging Face gradient checkpointing with and without ``offload_checkpointing()``)
are measured once each: ``--warmup`` unmeasured then ``--steps`` timed steps, activation
peak = most allocated during a step minus allocated before it. Then, per budget, no
lever, the plan and the best single lever that fits (fastest measured whose peak is
within the budget) are measured in ``--ab-rounds`` rounds of alternating blocks (the
order of each round reversed from the one before; a block: ``--warmup`` + ``--steps``
steps). Ratios are medians of the pooled timed steps over no lever's; ``host/device``:
the plan's median host time per step over its median device time (near 1: the step is
paced by the host, and its time follows the host's speed). ``--repeats`` repeats
every case from a fresh model and a fresh measurement (``run`` in each case's JSON).

Verdict per budget: ``fits`` (the plan's peak within the budget), ``target`` (plan x none
within the issue's target), ``vs_single`` (plan / best single lever <= 1.02).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import offload
from offload import _measure
from offload._planner.costs import PlanCosts
from offload._planner.levers import summary
from offload._planner.search import candidates, single_levers
from offload.models import ReferenceModel

GIB = 2**30
VS_SINGLE = 1.02


@dataclasses.dataclass
class Case:
    name: str
    model: str  # "llama" or "ref"
    seq: int
    budgets: dict[str, float | None]  # name -> fraction (None: the HF offloaded peak)
    targets: dict[str, float]
    compress: str | None = None


CASES = [
    Case("llama-4k", "llama", 4096, {"50%": 0.5, "25%": 0.25, "hf ckpt+offload": None},
         {"50%": 1.15, "25%": 1.35}),
    Case("llama-16k", "llama", 16384, {"25%": 0.25}, {"25%": 1.25}),
    Case("ref-8L", "ref", 4096, {"75%": 0.75, "50%": 0.5, "25%": 0.25},
         {"75%": 1.02, "50%": 1.06, "25%": 1.15}),
    Case("ref-8L-fp8", "ref", 4096, {"50%": 0.5, "25%": 0.25}, {"25%": 1.10}, "fp8"),
]  # fmt: skip


# --------------------------------------------------------------------------------------
# models


def build(case: Case, device: torch.device, quick: bool) -> tuple[Any, list[Any], Callable]:
    """The model, its layers and a step function (forward + backward)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    seq = 32 if quick else case.seq
    if case.model == "ref":
        sizes = (4, 64, 4, 160) if quick else (8, 4096, 32, 14336)
        model = ReferenceModel(*sizes, device=device, dtype=dtype)
        x = torch.randn(1, seq, sizes[1], device=device, dtype=dtype)
        return model, list(model.layers), lambda: model.loss(x).backward()
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64 if quick else 2048,
        num_hidden_layers=4 if quick else 16,
        intermediate_size=160 if quick else 5632,
        num_attention_heads=4 if quick else 32,
        num_key_value_heads=2 if quick else 4,
        vocab_size=128 if quick else 32000,
        max_position_embeddings=max(seq, 4096),
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    layers = offload.find_layers(model)
    return model, layers, lambda: model(input_ids=tokens, labels=tokens).loss.backward()


def hf_checkpointing(model: Any, offloaded: bool) -> Callable[[], None]:
    """Hugging Face gradient checkpointing (non-reentrant), with ``offload_checkpointing``
    when ``offloaded``; returns the function that undoes it."""
    from offload.integrations.hf import offload_checkpointing

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    handle = offload_checkpointing(model) if offloaded else None

    def undo() -> None:
        if handle is not None:
            handle.remove()
        model.gradient_checkpointing_disable()

    return undo


# --------------------------------------------------------------------------------------
# measuring


def block(step: Callable[[], None], args: argparse.Namespace) -> dict[str, Any]:
    """``--warmup`` + ``--steps`` steps; per timed step the device time (CUDA events) and
    the host time (from the call to its return, the device synchronised before it): a
    host time close to the device time means the step is paced by the host."""
    host: list[float] = []

    def timed() -> None:
        start = time.perf_counter()
        step()
        host.append((time.perf_counter() - start) * 1e3)

    got = _measure.timed_steps(timed, args.steps, args.warmup, device=args.device)
    return {
        "times_ms": [t * 1e3 for t in got.seconds],
        "host_ms": host[args.warmup :],
        "peak_bytes": got.activation,
    }


def with_levers(
    levers: Sequence[str], layers: list[Any], model: Any, case: Case, args, recompute: str
):
    """Apply a plan of ``levers`` (its full recompute by ``recompute``, the scheme
    ``offload.plan`` measured faster); returns the function that removes it."""
    p = offload.Plan(
        layers, levers, compress=case.compress, min_tensor_bytes=args.min_bytes,
        recompute=recompute,
    )  # fmt: skip
    return p.apply(model).remove


def measure_config(install: Callable[[], Callable[[], None]], step, args) -> dict[str, Any]:
    undo = install()
    try:
        row = block(step, args)
    finally:
        undo()
    row["ms"] = statistics.median(row["times_ms"])
    return row


def alternating(configs: dict[str, Callable], step, args) -> dict[str, list[float]]:
    """Every configuration in ``--ab-rounds`` rounds of blocks, each round in the
    reverse order of the one before; the timed steps pooled per configuration."""
    names = list(configs)
    times: dict[str, list[float]] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    for r in range(args.ab_rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            undo = configs[name]()
            try:
                got = block(step, args)
            finally:
                undo()
            times[name] += got["times_ms"]
            host[name] += got["host_ms"]
            if got["peak_bytes"] is not None:
                peaks[name].append(got["peak_bytes"])
    return {
        n: {
            "times_ms": times[n],
            "ms": statistics.median(times[n]),
            "host_ms": statistics.median(host[n]),
            "peak_bytes": max(peaks[n], default=None),
        }
        for n in names
    }


def synthetic_costs(L: int, none_ms: float, compress: str | None) -> PlanCosts:
    """A cost model for the CPU smoke run (``offload.plan`` needs CUDA)."""
    f = none_ms / 1e3 / (3 * L)
    size = 64 << 20
    return PlanCosts(
        forward_s=[f] * L,
        backward_s=[2 * f] * L,
        saved_bytes=[size] * L,
        link_bytes=[size // 2] * L if compress else None,
        selective_kept=0.6,
        checkpoint_kept=0.05,
        selective_s=[0.3 * f] * L,
        checkpoint_s=[f] * L,
        d2h_bps=size / (1.5 * f),
        h2d_bps=size / (1.5 * f),
        workspace_bytes=size // 4,
        head_bytes=size // 2,
        step_s=none_ms / 1e3,
        activation_bytes=L * size + size // 2,
    )


# --------------------------------------------------------------------------------------
# one case


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.type == "cuda"
    model, layers, step = build(case, args.device, args.quick)
    L = len(layers)
    out: dict[str, Any] = {"case": dataclasses.asdict(case), "layers": L}
    none = measure_config(lambda: lambda: None, step, args)
    start = time.perf_counter()
    if cuda:
        base = offload.plan(
            step,
            layers,
            budget=1.0,
            model=model,
            compress=case.compress,
            min_tensor_bytes=args.min_bytes,
            verify=False,
        )
    else:
        costs = synthetic_costs(L, none["ms"], case.compress)
        base = offload.Plan(
            layers, ["keep"] * L, costs=costs, compress=case.compress, min_tensor_bytes=0
        )
    out["plan_s"] = time.perf_counter() - start
    costs = base.costs
    out["costs"] = costs.to_dict()
    out["measured_configs"] = base.measured.get("configs")
    out["recompute"] = base.recompute
    reference = costs.activation_bytes

    singles: dict[str, dict[str, Any]] = {}
    for name, levers in single_levers(costs):
        row = measure_config(
            lambda lv=levers: with_levers(lv, layers, model, case, args, base.recompute),
            step,
            args,
        )
        singles[name] = row | {"levers": levers}
    if case.model == "llama":
        for name, off in (("hf checkpointing", False), ("hf checkpointing + offload", True)):
            singles[name] = measure_config(lambda o=off: hf_checkpointing(model, o), step, args)
    out["singles"] = singles
    try:
        candidates(costs, 0.0)
    except ValueError as exc:  # the smallest feasible peak the model predicts
        out["smallest_feasible"] = str(exc)
    hf_peak = singles.get("hf checkpointing + offload", {}).get("peak_bytes")
    print(
        f"  {case.name}: {out.get('smallest_feasible')}; head {costs.head_bytes} B, "
        f"workspace {costs.workspace_bytes} B; hf checkpointing + offload peak {hf_peak} B",
        file=sys.stderr,
        flush=True,
    )

    budgets = []
    for bname, fraction in case.budgets.items():
        if fraction is None:
            peak = singles.get("hf checkpointing + offload", {}).get("peak_bytes")
            if peak is None:
                continue
            limit = int(peak)
        else:
            limit = fraction * reference
        row: dict[str, Any] = {"name": bname, "fraction": fraction, "budget_bytes": limit}
        start = time.perf_counter()
        try:
            budget_arg = int(limit) if fraction is None else fraction
            chosen = base.replan(budget_arg, step_fn=step if cuda else None, model=model)
        except ValueError as exc:
            row.update(error=str(exc), replan_s=time.perf_counter() - start)
            budgets.append(row)
            print(f"  {case.name} {bname}: no plan: {exc}", file=sys.stderr, flush=True)
            continue
        row["replan_s"] = time.perf_counter() - start
        row["plan"] = chosen.to_dict() | {"costs": None}
        fits = {
            n: s for n, s in singles.items()
            if s.get("levers") and (s["peak_bytes"] is None or s["peak_bytes"] <= limit)
        }  # fmt: skip
        best = min(fits, key=lambda n: fits[n]["ms"]) if fits else None
        row["best_single"] = best
        configs: dict[str, Callable] = {"none": lambda: lambda: None}
        configs["plan"] = lambda p=chosen: (p.apply(model), p.remove)[1]
        if best is not None and fits[best]["levers"] != chosen.levers:
            configs["single"] = lambda lv=fits[best]["levers"]: with_levers(
                lv, layers, model, case, args, base.recompute
            )
        ab = alternating(configs, step, args)
        row["ab"] = ab
        ratio = ab["plan"]["ms"] / ab["none"]["ms"]
        single_ms = ab["single"]["ms"] if "single" in ab else (ab["plan"]["ms"] if best else None)
        row["ratio_to_none"] = ratio
        row["ratio_to_single"] = ab["plan"]["ms"] / single_ms if single_ms else None
        peak = ab["plan"]["peak_bytes"]
        target = case.targets.get(bname)
        row["checks"] = {
            "fits": None if peak is None else peak <= limit,
            "target": None if target is None else ratio <= target,
            "vs_single": None
            if row["ratio_to_single"] is None
            else row["ratio_to_single"] <= VS_SINGLE,
        }
        known = [v for v in row["checks"].values() if v is not None]
        row["verdict"] = "n/a" if not known else ("pass" if all(known) else "FAIL")
        budgets.append(row)
        print(
            f"  {case.name} {bname}: {offload.Plan(layers, chosen.levers)!r} x none {ratio:.3f}"
            f" / single {row['ratio_to_single']}, {row['verdict']}",
            file=sys.stderr,
            flush=True,
        )
    out["budgets"] = budgets
    out["none"] = none
    return out


# --------------------------------------------------------------------------------------
# report and main


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title="plans against no lever (alternating blocks) and the best single lever")
    for col in (
        "case",
        "run",
        "budget",
        "GiB",
        "plan",
        "x none",
        "target",
        "best single",
        "plan/single",
        "host/device",
        "peak GiB",
        "verdict",
    ):
        table.add_column(col)
    for case in result["cases"]:
        for r in case["budgets"]:
            if "plan" not in r:
                table.add_row(
                    case["case"]["name"],
                    str(case.get("run", 1)),
                    r["name"],
                    f"{r['budget_bytes'] / GIB:.2f}",
                    "no plan",
                )
                continue
            peak = r["ab"]["plan"]["peak_bytes"]
            target = case["case"]["targets"].get(r["name"])
            table.add_row(
                case["case"]["name"],
                str(case.get("run", 1)),
                r["name"],
                f"{r['budget_bytes'] / GIB:.2f}",
                summary(r["plan"]["levers"]),
                f"{r['ratio_to_none']:.3f}",
                "-" if target is None else f"<= {target:.2f}",
                r["best_single"] or "none fits",
                "-" if r["ratio_to_single"] is None else f"{r['ratio_to_single']:.3f}",
                f"{r['ab']['plan']['host_ms'] / r['ab']['plan']['ms']:.2f}",
                "n/a" if peak is None else f"{peak / GIB:.2f}",
                r["verdict"],
            )
    console.print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per block")
    parser.add_argument("--ab-rounds", type=int, default=3, help="rounds of alternating blocks")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every case (fresh plans)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args(argv)
    if min(args.steps, args.warmup, args.ab_rounds, args.repeats) < 1:
        parser.error("--steps, --warmup, --ab-rounds and --repeats must be >= 1")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu --quick")
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    if args.device.type == "cpu" and not args.quick:
        parser.error("--device cpu is a smoke run: add --quick")
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    bad = [n for n in names if n not in {c.name for c in CASES}]
    if bad:
        parser.error(f"--cases: unknown {bad}; accepted: {', '.join(c.name for c in CASES)}")
    args.selected = [c for c in CASES if c.name in names]
    args.min_bytes = 0 if args.quick else 256 * 1024
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "bench_planner_models",
        "command": [sys.executable, *sys.argv],
        "settings": {k: v for k, v in vars(args).items() if k not in ("device", "selected")},
        "targets_vs_single": VS_SINGLE,
        "environment": {
            "torch": torch.__version__,
            "offload": offload.__version__,
            "device": str(args.device),
            "gpu": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else None,
        },
        "cases": [],
    }
    target = Path(args.out)
    target.parent.mkdir(parents=True, exist_ok=True)
    for run in range(args.repeats):
        for case in args.selected:
            print(f"{case.name}, run {run + 1} of {args.repeats} ...", file=sys.stderr, flush=True)
            result["cases"].append(run_case(case, args) | {"run": run + 1})
            # written after every case: a run cut short keeps what it measured
            result["wall_s"] = time.perf_counter() - started
            target.write_text(json.dumps(result, indent=1, default=str) + "\n")
    report(result)
    print(f"written to {target} ({result['wall_s']:.0f} s)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
