"""Weight offloading on the "ref-8L" model: step time and memory against no offloading,
for inference and for LoRA-style training, as the tokens per layer call grow.

Command (one GPU, default sizes; about a minute on an H200, well under 4 minutes)::

    PYTHONPATH=. python3 benchmarks/weights/bench_weights.py --out benchmarks/results/weights.json

CPU smoke run (tiny sizes, one CPU thread, CUDA-only columns print n/a; a few seconds)::

    PYTHONPATH=. python3 benchmarks/weights/bench_weights.py --quick --device cpu --out /tmp/w.json

Model (docs/performance.md, "ref-8L"): L = 8 ``offload.models.ReferenceBlock``
layers (RMSNorm, fused QKV, causal SDPA, output projection, RMSNorm, SwiGLU MLP with
fused gate/up, residuals; no bias), hidden 4096, 32 heads, ffn 14336, bf16 weights:
464 MiB of weights per layer, 3.62 GiB in all. Built once (seed 0); every row uses the
same weights.

Modes:

* ``inference``: every weight frozen, the forward under ``torch.no_grad()``.
* ``lora``: the four projections of every layer get a LoRA adapter (``--rank`` 16,
  A random, B zero, both trainable, kept in the layer so they are offloaded too); every
  base weight and norm is frozen; a step is forward + backward of the mean of squares
  of the output (fp32); the input does not require grad; the adapters' gradients stay
  on the GPU (``grads="device"``); no optimizer step.

Tokens per layer call: ``--tokens`` (default 4096, 8192, 16384), as ``--seq`` (4096)
x batch (tokens / seq; a smaller count is one sequence of that length).

Methods: ``none`` (weights on the GPU) and ``offload p=n``:
``offload.WeightOffloader(layers, prefetch_layers=n)`` for each n of ``--prefetch``
(default 1), built after the ``none`` rows of a mode and closed after its rows.

Columns (definitions):

* ``step ms``: median over ``--steps`` (5) timed steps after ``--warmup`` (2) of the
  device time of one step: CUDA events on the compute stream around forward (+
  backward), after a device synchronisation (``perf_counter`` on the CPU).
* ``x none``: step ms / step ms of the ``none`` row of the same mode and tokens.
* ``model ms``: what overlap alone predicts, from the ``none`` row's per-layer forward F
  and backward B (its forward and backward times / L) and the time T = layer bytes /
  pinned H2D bandwidth (1 GiB, measured at the start of the run) of one layer's copy:
  forward ``T + (L - 1) max(F, T) + F`` (the first layer's copy is exposed; each later
  one overlaps the layer before it), backward ``(L - 1) max(B, T) + B`` (the last layer
  stays from its forward). A row far above it loses overlap somewhere.
* ``peak GiB``: ``torch.cuda.max_memory_allocated()`` during one more step, after
  ``reset_peak_memory_stats`` (absolute: weights on the GPU, activations, gradients).
* ``saved GiB``: peak of ``none`` minus peak of this row.
* ``off GiB``: weight bytes that were not on the GPU even at the busiest moment:
  ``offloader.bytes_offloaded - max_resident_layers * layer bytes``.
* ``on-demand``: refills per step that were issued only when their layer started
  (``refills_on_demand``; 1 = only the first layer's forward, the expected value).

Also measured and printed: pinned memcpy bandwidth (256 MiB and 1 GiB, each direction;
``_common.pinned_bandwidth``); for inference, whether the offloaded output equals the
``none`` output bitwise (``same_output``, JSON only). Every raw time is in the JSON.

The physics: one layer's 464 MiB take ~8.9 ms at ~55 GB/s, against F = 3.33 ms and B =
7.26 ms at 4096 tokens (docs/performance.md): the copies hide behind the compute only
when a layer call has about 3x as many tokens (more for inference, which has no
backward to hide the copies of the backward behind).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import offload
from benchmarks._common import (
    GIB,
    Timer,
    environment,
    free_cached,
    median,
    pinned_bandwidth,
    synchronize,
    write_json,
)
from offload.models import ReferenceBlock

DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the benchmarked model."""

    hidden: int = 4096
    heads: int = 32
    ffn: int = 14336
    layers: int = 8
    seq: int = 4096


QUICK = ModelConfig(hidden=64, heads=4, ffn=128, layers=4, seq=32)
QUICK_TOKENS = (32, 64)


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + B (A x)``."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        kw: dict[str, Any] = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.a = nn.Parameter(torch.randn(rank, base.in_features, **kw) / base.in_features**0.5)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


def build(cfg: ModelConfig, device: torch.device, lora_rank: int | None) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList(
        ReferenceBlock(cfg.hidden, cfg.heads, cfg.ffn, device=device, dtype=DTYPE)
        for _ in range(cfg.layers)
    )
    layers.requires_grad_(False)
    if lora_rank is not None:
        for block in layers:
            for name in ("qkv", "out", "gate_up", "down"):
                setattr(block, name, LoraLinear(getattr(block, name), lora_rank))
    return layers


def run(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def shape_for(tokens: int, seq: int) -> tuple[int, int]:
    """(batch, seq) for ``tokens`` tokens per layer call."""
    if tokens <= seq:
        return 1, tokens
    if tokens % seq:
        raise ValueError(f"--tokens {tokens} is not a multiple of --seq {seq}")
    return tokens // seq, seq


def measure(
    layers: nn.ModuleList,
    mode: str,
    x: torch.Tensor,
    device: torch.device,
    steps: int,
    warmup: int,
    off: offload.WeightOffloader | None,
) -> dict[str, Any]:
    """Warm-up, timed steps, one memory step; the forward output of the last step."""
    timer = Timer(device)
    cuda = device.type == "cuda"
    fwd_ms, bwd_ms, step_ms, on_demand = [], [], [], []
    out = None

    def step() -> tuple[Any, Any, Any]:
        nonlocal out
        start = timer.mark()
        if mode == "inference":
            with torch.no_grad():
                out = run(layers, x)
            mid = end = timer.mark()
        else:
            loss = run(layers, x).float().square().mean()
            mid = timer.mark()
            loss.backward()
            end = timer.mark()
            out = loss.detach()
        return start, mid, end

    for i in range(warmup + steps):
        layers.zero_grad(set_to_none=True)
        before = off.refills_on_demand if off is not None else 0
        synchronize(device)
        start, mid, end = step()
        synchronize(device)
        if i >= warmup:
            fwd_ms.append(timer.elapsed_ms(start, mid))
            bwd_ms.append(timer.elapsed_ms(mid, end))
            step_ms.append(timer.elapsed_ms(start, end))
            if off is not None:
                on_demand.append(off.refills_on_demand - before)
    peak = None
    if cuda:
        out = None
        layers.zero_grad(set_to_none=True)
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    row: dict[str, Any] = {
        "step_ms": step_ms,
        "forward_ms": fwd_ms,
        "backward_ms": bwd_ms,
        "step_ms_median": median(step_ms),
        "forward_ms_median": median(fwd_ms),
        "backward_ms_median": median(bwd_ms),
        "peak_allocated_bytes": peak,
        "output": out.detach().cpu(),  # off the GPU: later rows' peaks must not see it
    }
    if off is not None:
        row.update(
            refills_on_demand_per_step=on_demand,
            bytes_offloaded=off.bytes_offloaded,
            max_resident_layers=off.max_resident_layers,
            pinned_bytes=off.pinned_bytes,
        )
    return row


def predict_ms(none_row: dict[str, Any], layers: int, layer_bytes: int, h2d_gbps: float | None):
    """The overlap model of the header (``model ms``); None without a measured link."""
    if not h2d_gbps:
        return None
    t = layer_bytes / (h2d_gbps * 1e9) * 1e3
    f = none_row["forward_ms_median"] / layers
    b = none_row["backward_ms_median"] / layers
    forward = t + (layers - 1) * max(f, t) + f
    backward = (layers - 1) * max(b, t) + b if b > 0 else 0.0
    return forward + backward


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    memcpy = result.get("memcpy")
    if memcpy:
        console.print(
            "pinned memcpy GB/s (1 GiB): "
            f"D2H {memcpy['d2h']['1 GiB']['gbps']:.1f}, H2D {memcpy['h2d']['1 GiB']['gbps']:.1f}"
        )
    s = result["settings"]
    console.print(
        f"model: {s['model_name']} {s['model']}, {s['layer_bytes'] / 2**20:.1f} MiB of weights "
        f"per layer ({s['weight_bytes'] / GIB:.2f} GiB), LoRA rank {s['rank']}"
    )
    table = Table(title="bench_weights: WeightOffloader vs weights on the GPU")
    for col in ("mode", "tokens", "method", "step ms", "x none", "model ms", "peak GiB",
                "saved GiB", "off GiB", "on-demand"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("mode", "method") else "right")
    modes = result["settings"]["modes"]
    ordered = sorted(
        result["rows"],
        key=lambda r: (modes.index(r["mode"]), r["tokens"], r.get("prefetch", -1)),
    )
    for row in ordered:
        on_demand = row.get("refills_on_demand_per_step")
        table.add_row(
            row["mode"],
            str(row["tokens"]),
            row["method"],
            f"{row['step_ms_median']:.1f}",
            f"{row['ratio_to_none']:.2f}",
            _fmt(row.get("model_ms"), ".1f"),
            _fmt(
                None if row["peak_allocated_bytes"] is None else row["peak_allocated_bytes"] / GIB,
                ".2f",
            ),
            _fmt(row.get("saved_bytes") and row["saved_bytes"] / GIB, ".2f"),
            _fmt(row.get("off_bytes") and row["off_bytes"] / GIB, ".2f"),
            "" if not on_demand else f"{median(on_demand):.0f}",
        )
    console.print(table)
    console.print(
        f"step ms: median of {s['steps']} timed steps after {s['warmup']} warm-up; x none: "
        "ratio to the none row of the same mode and tokens; model ms: overlap prediction "
        "from F, B of the none row and T = layer bytes / pinned H2D; saved GiB: peak of "
        "none - peak of the row; off GiB: weights never on the GPU during the step. "
        "Definitions: header of benchmarks/weights/bench_weights.py."
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    size = parser.add_argument_group("model sizes (default: ref-8L; --quick: tiny)")
    for name in ("hidden", "ffn", "heads", "layers", "seq"):
        size.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--tokens", default=None, help="tokens per layer call, comma-separated "
                        "(default 4096,8192,16384; --quick 32,64)")  # fmt: skip
    parser.add_argument("--modes", default="inference,lora", help="inference and/or lora")
    parser.add_argument("--prefetch", default="1", help="prefetch_layers values, comma-separated")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (>= 3)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per row (>= 1)")
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else ModelConfig()
    args.model = dataclasses.replace(
        base,
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(ModelConfig)
            if getattr(args, f.name) is not None
        },
    )
    try:
        if args.tokens is None:
            args.tokens = list(QUICK_TOKENS if args.quick else (4096, 8192, 16384))
        else:
            args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        args.prefetch = [int(p) for p in args.prefetch.split(",") if p.strip()]
    except ValueError:
        parser.error("--tokens and --prefetch take comma-separated ints")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("inference", "lora") for m in args.modes):
        parser.error(f"--modes {args.modes}: each must be inference or lora")
    for t in args.tokens:
        try:
            shape_for(t, args.model.seq)
        except ValueError as exc:
            parser.error(str(exc))
    if args.steps < 3 or args.warmup < 1:
        parser.error("--steps >= 3 and --warmup >= 1")
    if args.model.hidden % args.model.heads:
        parser.error(f"--hidden {args.model.hidden} is not divisible by --heads {args.model.heads}")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu (with --quick)")
    if args.device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device}: only cuda and cpu are supported")
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
        "benchmark": "bench_weights",
        "command": [sys.executable, *sys.argv],
        "settings": {
            "model_name": "ref-8L" if cfg == ModelConfig() else "ref-8L (custom sizes)",
            "model": dataclasses.asdict(cfg),
            "dtype": str(DTYPE),
            "tokens": args.tokens,
            "modes": args.modes,
            "prefetch": args.prefetch,
            "rank": args.rank,
            "steps": args.steps,
            "warmup": args.warmup,
            "quick": args.quick,
        },
        "environment": environment(device),
    }
    result["memcpy"] = pinned_bandwidth(device) if device.type == "cuda" else None
    h2d = result["memcpy"]["h2d"]["1 GiB"]["gbps"] if result["memcpy"] else None

    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        layers = build(cfg, device, args.rank if mode == "lora" else None)
        weight_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
        layer_bytes = weight_bytes // cfg.layers
        result["settings"].update(weight_bytes=weight_bytes, layer_bytes=layer_bytes)
        inputs = {}
        for tokens in args.tokens:
            batch, seq = shape_for(tokens, cfg.seq)
            g = torch.Generator(device=device).manual_seed(tokens)
            inputs[tokens] = torch.randn(
                batch, seq, cfg.hidden, device=device, dtype=DTYPE, generator=g
            )
        none: dict[int, dict[str, Any]] = {}
        for tokens in args.tokens:
            row = measure(layers, mode, inputs[tokens], device, args.steps, args.warmup, None)
            row.update(mode=mode, tokens=tokens, method="none", ratio_to_none=1.0)
            none[tokens] = row
            rows.append(row)
        for p in args.prefetch:
            off = offload.WeightOffloader(layers, prefetch_layers=p)
            for tokens in args.tokens:
                row = measure(layers, mode, inputs[tokens], device, args.steps, args.warmup, off)
                ref = none[tokens]
                row.update(mode=mode, tokens=tokens, method=f"offload p={p}", prefetch=p)
                row["ratio_to_none"] = row["step_ms_median"] / ref["step_ms_median"]
                row["model_ms"] = predict_ms(ref, cfg.layers, layer_bytes, h2d)
                if row["peak_allocated_bytes"] is not None:
                    row["saved_bytes"] = ref["peak_allocated_bytes"] - row["peak_allocated_bytes"]
                row["off_bytes"] = off.bytes_offloaded - off.max_resident_layers * layer_bytes
                row["same_output"] = bool(torch.equal(row["output"], ref["output"]))
                rows.append(row)
            off.close()
        del layers, inputs
        free_cached(device)
    for row in rows:
        row.pop("output", None)
    result["rows"] = rows
    print_report(result)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
