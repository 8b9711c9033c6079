"""Offloaded checkpointing vs torch checkpointing: step time, peak memory, longest sequence.

Command (one GPU, default sizes: 8 Llama layers at hidden 4096, seq 8k, 16k, 32k; about
1-2 minutes on an H200, under 30 GiB of GPU memory and about 2 GiB of pinned host
memory)::

    PYTHONPATH=. python3 benchmarks/checkpoint/bench_checkpoint.py --out benchmarks/results/checkpoint.json

Other sequence lengths, more layers, other memory caps::

    PYTHONPATH=. python3 benchmarks/checkpoint/bench_checkpoint.py --seqs 4096,8192,16384 \\
        --layers 16 --cap-gib 40 80 --out /tmp/checkpoint_16l.json

CPU smoke run (tiny model, a few seconds; CUDA-only columns print n/a)::

    PYTHONPATH=. python3 benchmarks/checkpoint/bench_checkpoint.py --quick --device cpu --out /tmp/c.json

Model: ``--layers`` (8) ``offload.models.ReferenceBlock`` layers (Llama-style: RMSNorm,
fused QKV, causal SDPA, output projection, RMSNorm, SwiGLU MLP, residuals; no RoPE, no
embedding, no head), hidden 4096, 32 heads, ffn 14336, batch 1, bf16 weights; loss = mean
of squares of the last layer's output, in fp32. Built once (seed 0); both modes use the
same weights. The input (``batch x seq x hidden``, bf16, not requiring grad) is made
before the step and handed over so that the step holds the only reference, like an
embedding output: once layer 0 has run, nothing but the checkpoint keeps it.

Modes, in this one process, for every sequence length:

* ``checkpoint``: ``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)``
  around every layer;
* ``offload.checkpoint``: ``offload.CheckpointOffloader().checkpoint(layer, x)`` around
  every layer (default settings: ``prefetch_layers=1``, pinned pool; ``--quick`` sets
  ``min_tensor_bytes=0`` so that its tiny inputs are offloaded at all).

A step is forward + backward (no optimizer step). Per (seq, mode): ``--warmup`` (2)
untimed steps, then ``--steps`` (5, at least 5) timed steps. The weights' gradients are
allocated by the first warm-up step and zeroed in place before each later step, outside
the timed span, as with persistent gradient buffers (DDP buckets, ``main_grad``): the
peak is then where the activations peak (the backward of the last layer, when torch's
checkpointing holds every layer's input), not at the end of the backward where the
gradients of every layer have been allocated while most inputs are already gone.

Columns (definitions):

* ``seq``: sequence length (tokens per sequence; batch ``--batch``).
* ``step ms``: median over the timed steps of the device time of one step: CUDA events
  recorded on the compute stream around forward + backward, after a device
  synchronisation (``perf_counter`` on the CPU). Every raw time is in the JSON.
* ``x ckpt``: step ms / step ms of ``checkpoint`` at the same seq.
* ``peak GiB``: ``torch.cuda.max_memory_allocated()`` over the timed steps, absolute
  (weights, gradients, everything), after ``reset_peak_memory_stats()``. ``act GiB``:
  that peak minus ``torch.cuda.memory_allocated()`` before the first timed step
  (weights + gradients + the input): what the step adds.
* ``inputs``: the checkpoint input bytes, ``layers x batch x seq x hidden x 2``: what
  torch's checkpointing keeps on the device for the backward, and what offloading can
  take off it.
* ``drop GiB``: peak of ``checkpoint`` minus peak of ``offload.checkpoint`` at that seq;
  ``drop/inputs``: its share of the input bytes. Expect about ``(layers - 1 -
  prefetch_layers) / layers`` of them or more: at the peak (the backward of the last
  layer) the last layer's input and the prefetched one are back on the device.
* ``D2H`` / ``H2D``: bytes offloaded and reloaded per step (the offloader's stats,
  ``bytes_offloaded`` / ``bytes_reloaded`` of the last timed step). ``inputs``, ``D2H``
  and ``H2D`` print in binary units (KiB, MiB, GiB).

Longest sequence under a memory cap (``--cap-gib``, one or more values, GiB = 2^30 B),
computed from the measured peaks, not measured: for each mode, a least-squares line
``peak(seq) = a + b * seq`` through the measured (seq, peak) points (peak memory grows
linearly in seq here: weights and gradients are constant, activations, checkpoint
inputs and SDPA's memory-efficient attention are linear), then ``seq_max = (cap - a) /
b`` rounded down to a multiple of 256 (at ``--batch``). The table prints both modes,
their ratio, and the largest residual of each fit; a seq_max beyond the largest measured
seq is an extrapolation (marked ``*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import offload
from benchmarks._common import GIB, Timer, environment, median, synchronize, write_json
from offload.models import ReferenceBlock
from offload.profiling import format_bytes

MODES = ("checkpoint", "offload.checkpoint")
SEQ_MULTIPLE = 256


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the benchmarked model."""

    hidden: int = 4096
    heads: int = 32
    ffn: int = 14336
    layers: int = 8
    batch: int = 1


QUICK = ModelConfig(hidden=64, heads=4, ffn=128, layers=4, batch=1)


def build(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        ReferenceBlock(cfg.hidden, cfg.heads, cfg.ffn, device=device, dtype=dtype)
        for _ in range(cfg.layers)
    )


def torch_ckpt(function: Callable[..., Any], x: torch.Tensor) -> Any:
    """The baseline: torch's non-reentrant checkpoint."""
    return torch_checkpoint(function, x, use_reentrant=False)


def make_step(
    layers: nn.ModuleList, ckpt: Callable[..., Any]
) -> Callable[[list[torch.Tensor]], None]:
    """forward + backward; takes the input out of ``box`` so that it holds the only
    reference (layer 0's input is freed once only the checkpoint could keep it)."""

    def step(box: list[torch.Tensor]) -> None:
        h = box.pop()
        for layer in layers:
            h = ckpt(layer, h)
        loss = h.float().square().mean()
        del h
        loss.backward()

    return step


def measure(
    layers: nn.ModuleList,
    cfg: ModelConfig,
    seq: int,
    mode: str,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    offloader = None
    if mode == "checkpoint":
        ckpt: Callable[..., Any] = torch_ckpt
    else:
        offloader = offload.CheckpointOffloader(min_tensor_bytes=0 if args.quick else 256 * 1024)
        ckpt = offloader.checkpoint
    step = make_step(layers, ckpt)
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(seq)

    def new_box() -> list[torch.Tensor]:
        x = torch.randn(cfg.batch, seq, cfg.hidden, device=device, dtype=dtype, generator=gen)
        return [x]

    def zero_grad() -> None:
        for p in layers.parameters():
            if p.grad is not None:
                p.grad.zero_()

    for _ in range(args.warmup):
        zero_grad()
        step(new_box())
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, walls = [], []
    allocated_before = None
    for i in range(args.steps):
        zero_grad()
        box = new_box()
        if cuda and i == 0:
            synchronize(device)
            allocated_before = torch.cuda.memory_allocated(device)  # weights, grads, input
        if offloader is not None and i == args.steps - 1:
            offloader.reset_stats()
        synchronize(device)
        wall = time.perf_counter()
        start = timer.mark()
        step(box)
        end = timer.mark()
        synchronize(device)
        walls.append((time.perf_counter() - wall) * 1e3)
        times.append(timer.elapsed_ms(start, end))
    row: dict[str, Any] = {
        "mode": mode,
        "seq": seq,
        "batch": cfg.batch,
        "step_ms": median(times),
        "step_ms_all": times,
        "wall_ms_all": walls,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "allocated_before_step_bytes": allocated_before,
        "checkpoint_input_bytes": cfg.layers * cfg.batch * seq * cfg.hidden * dtype.itemsize,
        "bytes_offloaded": 0,
        "bytes_reloaded": 0,
    }
    if offloader is not None:
        stats = offloader.stats
        row.update(
            bytes_offloaded=stats.bytes_offloaded,
            bytes_reloaded=stats.bytes_reloaded,
            reloads_prefetched=stats.reloads_prefetched,
            reloads_on_demand=stats.reloads_on_demand,
            host_pool_reserved_bytes=stats.host_pool_reserved_bytes,
            offloader_stats=stats.to_dict(),
        )
        offloader.close()
    for p in layers.parameters():
        p.grad = None
    del step, ckpt, offloader
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b, largest |residual|)``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    resid = max(abs(y - (a + b * x)) for x, y in points)
    return a, b, resid


def cap_table(rows: list[dict[str, Any]], caps: Sequence[float]) -> dict[str, Any] | None:
    """Longest seq under each cap, per mode, from the linear fit of the measured peaks."""
    fits: dict[str, dict[str, float]] = {}
    for mode in MODES:
        points = [
            (float(r["seq"]), float(r["peak_allocated_bytes"]))
            for r in rows
            if r["mode"] == mode and r["peak_allocated_bytes"] is not None
        ]
        if len({x for x, _ in points}) < 2:
            return None
        a, b, resid = fit_line(points)
        fits[mode] = {"intercept_bytes": a, "bytes_per_token": b, "max_residual_bytes": resid}
    largest = max(r["seq"] for r in rows)
    table = []
    for cap in caps:
        entry: dict[str, Any] = {"cap_gib": cap}
        for mode in MODES:
            f = fits[mode]
            seq = (cap * GIB - f["intercept_bytes"]) / f["bytes_per_token"]
            seq_max = max(0, int(seq) // SEQ_MULTIPLE * SEQ_MULTIPLE)
            entry[mode] = {"seq_max": seq_max, "extrapolated": seq_max > largest}
        base = entry["checkpoint"]["seq_max"]
        entry["ratio"] = entry["offload.checkpoint"]["seq_max"] / base if base else None
        table.append(entry)
    return {
        "method": (
            "least-squares line peak(seq) = a + b*seq through the measured peaks of each "
            f"mode; seq_max = (cap - a) / b, rounded down to a multiple of {SEQ_MULTIPLE}"
        ),
        "fits": fits,
        "caps": table,
    }


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\n{cfg['layers']} layers, hidden {cfg['hidden']}, heads {cfg['heads']}, ffn "
        f"{cfg['ffn']}, batch {cfg['batch']}, {result['dtype']} on {result['device']}; "
        f"{result['steps']} timed steps after {result['warmup']} warm-up"
    )
    header = (
        f"{'seq':>7} {'mode':<19} {'step ms':>9} {'x ckpt':>7} {'peak GiB':>9} {'act GiB':>8} "
        f"{'inputs':>10} {'drop GiB':>9} {'drop/inputs':>11} {'D2H':>10} {'H2D':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = result["rows"]
    for r in rows:
        base = next(b for b in rows if b["seq"] == r["seq"] and b["mode"] == "checkpoint")
        ratio = r["step_ms"] / base["step_ms"]
        act = None
        if r["peak_allocated_bytes"] is not None:
            act = r["peak_allocated_bytes"] - r["allocated_before_step_bytes"]
        drop = share = "-"
        if r["mode"] != "checkpoint":
            if r["peak_allocated_bytes"] is None:
                drop = share = "n/a"
            else:
                d = base["peak_allocated_bytes"] - r["peak_allocated_bytes"]
                drop = f"{d / GIB:.2f}"
                share = f"{d / r['checkpoint_input_bytes']:.2f}"
        print(
            f"{r['seq']:>7} {r['mode']:<19} {r['step_ms']:>9.1f} {ratio:>7.3f} "
            f"{_gib(r['peak_allocated_bytes']):>9} {_gib(act):>8} "
            f"{format_bytes(r['checkpoint_input_bytes']):>10} {drop:>9} {share:>11} "
            f"{format_bytes(r['bytes_offloaded']):>10} {format_bytes(r['bytes_reloaded']):>10}"
        )
    caps = result["cap_table"]
    if caps is None:
        print("\nlongest sequence under a cap: n/a (needs CUDA peaks at >= 2 sequence lengths)")
        return
    print(f"\nlongest sequence under a memory cap ({caps['method']}; * = extrapolated)")
    for mode, f in caps["fits"].items():
        print(
            f"  fit {mode:<19} a = {f['intercept_bytes'] / GIB:6.2f} GiB, "
            f"b = {f['bytes_per_token'] / 2**10:8.1f} KiB/token, max residual "
            f"{f['max_residual_bytes'] / 2**20:.1f} MiB"
        )
    print(f"{'cap GiB':>8} {'checkpoint':>12} {'offload.checkpoint':>19} {'ratio':>7}")

    def cell(entry: dict[str, Any], mode: str) -> str:
        c = entry[mode]
        return f"{c['seq_max']}{'*' if c['extrapolated'] else ''}"

    for e in caps["caps"]:
        ratio = "n/a" if e["ratio"] is None else f"{e['ratio']:.3f}"
        print(
            f"{e['cap_gib']:>8g} {cell(e, 'checkpoint'):>12} "
            f"{cell(e, 'offload.checkpoint'):>19} {ratio:>7}"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    size = parser.add_argument_group(
        "model sizes (default: 8 layers at hidden 4096; --quick: tiny)"
    )
    for name in ("hidden", "heads", "ffn", "layers", "batch"):
        size.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument(
        "--seqs",
        default=None,
        help="comma-separated sequence lengths (default 8192,16384,32768; --quick 64,128)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (>= 5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per row (>= 1)")
    parser.add_argument(
        "--cap-gib", type=float, nargs="+", default=[40.0, 80.0], help="memory caps, GiB"
    )
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model (CPU smoke run)")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else ModelConfig()
    args.config = dataclasses.replace(
        base,
        **{
            k: getattr(args, k)
            for k in ("hidden", "heads", "ffn", "layers", "batch")
            if getattr(args, k) is not None
        },
    )
    seqs = args.seqs or ("64,128" if args.quick else "8192,16384,32768")
    try:
        args.seq_list = [int(s) for s in seqs.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seqs {seqs!r}: expected comma-separated integers")
    if not args.seq_list or min(args.seq_list) < 1:
        parser.error(f"--seqs {seqs!r}: expected positive integers")
    if args.steps < 5:
        parser.error(f"--steps {args.steps}: at least 5 (the median of >= 5 steps)")
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu (with --quick)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
    else:
        torch.set_num_threads(min(4, torch.get_num_threads()))
        dtype = torch.float32  # bf16 matmuls are slow on many CPUs
    cfg = args.config
    layers = build(cfg, device, dtype)
    rows = []
    for seq in args.seq_list:
        for mode in MODES:
            row = measure(layers, cfg, seq, mode, args, device, dtype)
            rows.append(row)
            print(
                f"  seq {seq:>6} {mode:<19} step {row['step_ms']:.1f} ms, peak "
                f"{_gib(row['peak_allocated_bytes'])} GiB",
                flush=True,
            )
    result = {
        "benchmark": "bench_checkpoint",
        "command": " ".join(sys.argv),
        "config": dataclasses.asdict(cfg),
        "seqs": args.seq_list,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "steps": args.steps,
        "warmup": args.warmup,
        "environment": environment(device),
        "rows": rows,
        "cap_table": cap_table(rows, args.cap_gib),
    }
    print_report(result)
    write_json(args.out, result)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
