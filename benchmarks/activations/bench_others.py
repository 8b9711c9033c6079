"""Other ways to save activation memory on "ref-8L": torch.compile's memory budget,
torchtune's offloader and TransformerEngine's, each against no offloading in one process.

Command (one GPU; a few minutes on an H200, most of it compiling)::

    PYTHONPATH=. python3 benchmarks/activations/bench_others.py \\
        --out benchmarks/results/others_ref8l.json

CPU smoke run (tiny sizes; the compiled rows compile for the CPU)::

    PYTHONPATH=. python3 benchmarks/activations/bench_others.py --quick --device cpu \\
        --methods compile --budgets 0.5 --out /tmp/others.json

The model, the step and every column are those of ``bench_activations.py`` (same
``Block``, same ``measure_row``: ``step ms`` median of ``--steps`` timed steps after
``--warmup``, ``act GiB`` = peak allocated during a step minus allocated before it).
Rows, each measured after the previous one is closed:

* ``no offload``;
* ``compile``: the whole forward and loss under ``torch.compile``, with
  ``torch._functorch.config.activation_memory_budget`` = each of ``--budgets`` (1.0: the
  compiler's default partition; smaller: it recomputes more to stay under that share of
  the activations). Compilation happens in the warm-up steps;
* ``torchtune``: ``torchtune.training.OffloadActivations()`` (one instance, entered
  around the layers every step), when torchtune is installed;
* ``te``: TransformerEngine's ``get_cpu_offload_context(True, k, L, True, False)`` for
  each k of ``--te-ks``, driven by its manual loop (``with ctx: x = layer(x)`` then
  ``x = sync(x)``), when transformer_engine is installed. TransformerEngine refuses a
  contiguous view of a non-contiguous base, which the output projection of ref-8L saves
  (the attention output transposed back), so these rows, their own ``no offload
  (cloned attention)`` reference and ``offload k`` rows of this package at the same k
  run on blocks whose attention output is cloned.

A method whose package is missing is listed under ``skipped`` in the JSON with the
reason, and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._common import GIB, Timer, environment, write_json
from benchmarks.activations.bench_activations import (
    PRESETS,
    QUICK,
    Bench,
    Block,
    ModelConfig,
    Offloaded,
    Runner,
    loss_of,
    measure_row,
    run_layers,
)

METHODS = ("none", "compile", "torchtune", "te")


class ClonedBlock(Block):
    """``Block`` whose attention output is cloned before the output projection, so that
    the projection saves a tensor that owns its storage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d).clone())
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class CompiledBudget(Runner):
    """The forward and loss compiled whole, under an activation memory budget."""

    def __init__(self, layers: nn.ModuleList, budget: float) -> None:
        super().__init__(layers)
        torch._dynamo.reset()
        self.budget = budget
        self.name = f"torch.compile, memory budget {budget:g}"
        self.fn = torch.compile(lambda x: loss_of(run_layers(layers, x)))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return self.fn(x)

    def close(self) -> None:
        torch._dynamo.reset()


class Torchtune(Runner):
    """torchtune's ``OffloadActivations`` around the layers."""

    name = "torchtune OffloadActivations"

    def __init__(self, layers: nn.ModuleList, factory: Callable[[], Any]) -> None:
        super().__init__(layers)
        self.ctx = factory()

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx:
            y = run_layers(self.layers, x)
        return loss_of(y)


class TransformerEngine(Runner):
    """TransformerEngine's ``get_cpu_offload_context`` over the first k layers."""

    def __init__(self, layers: nn.ModuleList, k: int, get_context: Callable[..., Any]) -> None:
        super().__init__(layers)
        self.ctx, self.sync = get_context(True, k, len(layers), True, False)
        self.name = f"TransformerEngine offload k={k}"

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with self.ctx:
                x = layer(x)
            x = self.sync(x)
        return loss_of(x)


def _import(method: str) -> tuple[Any, str | None]:
    """The entry point of an optional package, or ``(None, reason)``."""
    try:
        if method == "torchtune":
            from torchtune.training import OffloadActivations

            return OffloadActivations, None
        from transformer_engine.pytorch import get_cpu_offload_context

        return get_cpu_offload_context, None
    except Exception as exc:  # not installed, or installed without its extensions
        return None, f"{type(exc).__name__}: {exc}"


def rows(
    layers: nn.ModuleList, cloned: nn.ModuleList, args: argparse.Namespace, skipped: dict
) -> Iterator[tuple[Runner, nn.ModuleList, dict[str, Any]]]:
    """The rows in order, each made only when the previous one is closed."""
    yield Runner(layers), layers, {"method": "none"}
    if "compile" in args.methods:
        for budget in args.budgets:
            yield CompiledBudget(layers, budget), layers, {"method": "compile", "budget": budget}
    if "torchtune" in args.methods:
        factory, reason = _import("torchtune")
        if factory is None:
            skipped["torchtune"] = reason
        else:
            yield Torchtune(layers, factory), layers, {"method": "torchtune"}
    if "te" in args.methods:
        get_context, reason = _import("te")
        if get_context is None:
            skipped["te"] = reason
            return
        reference = Runner(cloned)
        reference.name = "no offload (cloned attention)"
        yield reference, cloned, {"method": "none", "cloned": True}
        for k in args.te_ks:
            tags = {"method": "te", "k": k, "cloned": True}
            yield TransformerEngine(cloned, k, get_context), cloned, tags
        for k in args.te_ks:
            ours = Offloaded(cloned, k, double_buffering=False, min_tensor_bytes=args.min_bytes)
            ours.name += " (cloned attention)"
            yield ours, cloned, {"method": "offload", "k": k, "cloned": True}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--methods", default=",".join(METHODS), help=",".join(METHODS))
    parser.add_argument("--budgets", default="1.0,0.5,0.25", help="compile memory budgets")
    parser.add_argument(
        "--te-ks", default=None, help="TransformerEngine's num_layers values (4,6,7; --quick: 1,2)"
    )
    parser.add_argument("--steps", type=int, default=7, help="timed steps per row (>= 3)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per row (>= 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; accepted: {','.join(METHODS)}")
    args.methods = methods
    try:
        args.budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
        te_ks = args.te_ks or ("1,2" if args.quick else "4,6,7")
        args.te_ks = [int(k) for k in te_ks.split(",") if k.strip()]
    except ValueError:
        parser.error(f"--budgets / --te-ks: numbers expected; got {args.budgets!r}, {args.te_ks!r}")
    args.model = QUICK if args.quick else PRESETS["ref-8L"][0]
    bad = [k for k in args.te_ks if not 1 <= k <= args.model.layers - 1]
    if bad:
        parser.error(f"--te-ks {bad}: each must be in 1..{args.model.layers - 1}")
    if args.steps < 3 or args.warmup < 1:
        parser.error(f"--steps >= 3 and --warmup >= 1; got {args.steps}, {args.warmup}")
    args.min_bytes = 0 if args.quick else None
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu (with --quick)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device, cfg = args.device, args.model
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers))
    cloned = nn.ModuleList(ClonedBlock(cfg, device) for _ in range(cfg.layers))
    cloned.load_state_dict(layers.state_dict())
    timer = Timer(device)
    skipped: dict[str, str | None] = {}
    measured: list[dict[str, Any]] = []
    for runner, stack, tags in rows(layers, cloned, args, skipped):
        bench = Bench(stack, cfg, device, timer)
        measured.append(tags | measure_row(bench, runner, args.steps, args.warmup))
        runner.close()
        del runner
        bench.free()
    for row in measured:
        ref = next(
            r for r in measured if r["method"] == "none" and r.get("cloned") == row.get("cloned")
        )
        row["ratio_to_none"] = row["step_ms_median"] / ref["step_ms_median"]
    print(f"{'row':<48}{'step ms':>9}{'x none':>8}{'act GiB':>9}")
    for row in measured:
        act = row.get("activation_gib")
        act_text = f"{act:9.2f}" if act is not None else f"{'n/a':>9}"
        print(f"{row['name']:<48}{row['step_ms_median']:9.1f}{row['ratio_to_none']:8.2f}{act_text}")
    for method, reason in skipped.items():
        print(f"skipped {method}: {reason}")
    result = {
        "benchmark": "bench_others",
        "command": [sys.executable, *sys.argv],
        "settings": {
            "model": dataclasses.asdict(cfg) if isinstance(cfg, ModelConfig) else cfg,
            "methods": args.methods,
            "budgets": args.budgets,
            "te_ks": args.te_ks,
            "steps": args.steps,
            "warmup": args.warmup,
            "quick": args.quick,
            "gib": GIB,
        },
        "environment": environment(device),
        "rows": measured,
        "skipped": skipped,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
