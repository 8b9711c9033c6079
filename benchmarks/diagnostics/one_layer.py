"""What offloading one layer costs an HF Llama ~1.1B step, length by length.

Command (one H200, about a minute)::

    PYTHONPATH=. python3 benchmarks/diagnostics/one_layer.py --out one_layer.json

The least that offloading can move is one layer call: ``offload_layers=1`` offloads the
first decoder layer, released when the last layer starts and reloaded when the backward
of the second-to-last starts (the widest window the schedule gives). Where that costs
more than ``max_slowdown`` (1.03) over no offloading, no offloading choice meets it, and
"auto" can only offload nothing where memory allows.

Model: ``benchmarks._common.llama_1b_config`` (hidden 2048, 16 layers, ffn 5632, 32
heads, 4 KV heads), SDPA, bf16, random weights, batch 1. Per length of ``--lengths``:
two warm-up steps each way (the first step at a shape pays for kernel selection), then
``--blocks`` blocks of ``--steps`` steps each way in alternation (no offloading first in
even blocks); a step is forward + loss + backward with gradients set to ``None`` first,
timed with CUDA events after a synchronisation. Columns: the median step of each,
``ratio`` (medians), ``spread`` (fastest to slowest no-offloading step, the noise), the
bytes offloaded per step, and the offloaded step's activation peak against no
offloading's (``torch.cuda.max_memory_allocated`` during one step, less the memory
allocated before it).

``--phases N``: N more steps of each, split at the context entry and at the loss: the
device ms of each part (CUDA events) and the host's ms for the same part; a part whose
host time exceeds its device time is paced by the host.

``--trace 4096,8192``: at those lengths, one more step of each under ``torch.profiler``,
read as ``trace_plan.py`` reads a plan's step: device ms, the compute stream's busy and
idle time and its largest idle gaps (with the host-to-device copies running in them), the
copy streams' busy time, and host runtime calls over 100 us: where one layer's cost goes.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import offload
from benchmarks._common import environment, hf_step, llama_1b, write_json


def step(model: Any, ids: torch.Tensor, off: Any) -> float:
    return hf_step(model, ids, off)[1]


PHASES = ("enter", "forward", "backward")


def phased_step(model: Any, ids: torch.Tensor, off: Any) -> dict[str, float]:
    """One step as ``hf_step`` times it, split at the context entry and the loss: device
    ms between CUDA events recorded at each point, and the host's ms between the same
    points (no synchronisation inside the step: the host runs ahead where it can)."""
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    host = [time.perf_counter()]
    marks[0].record()
    with off if off is not None else contextlib.nullcontext():
        marks[1].record()
        host.append(time.perf_counter())
        loss = model(input_ids=ids, labels=ids).loss
        marks[2].record()
        host.append(time.perf_counter())
    loss.backward()
    marks[3].record()
    host.append(time.perf_counter())
    marks[3].synchronize()
    out = {"step": marks[0].elapsed_time(marks[3])}
    for i, name in enumerate(PHASES):
        out[name] = marks[i].elapsed_time(marks[i + 1])
        out[f"host_{name}"] = (host[i + 1] - host[i]) * 1e3
    return out


def phases(model: Any, ids: torch.Tensor, off: Any, steps: int) -> dict[str, float]:
    """Medians over ``steps`` phased steps of each part (see ``phased_step``)."""
    rows = [phased_step(model, ids, off) for _ in range(steps)]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def peak(model: Any, ids: torch.Tensor, off: Any) -> int:
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(model, ids, off)
    return torch.cuda.max_memory_allocated() - before


def measure(model: Any, off: Any, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator("cuda").manual_seed(seq)
    ids = torch.randint(0, 32000, (1, seq), device="cuda", generator=gen)
    for _ in range(2):
        step(model, ids, None)
        step(model, ids, off)
    none: list[float] = []
    one: list[float] = []
    for b in range(args.blocks):
        order = [(None, none), (off, one)]
        for o, out in order if b % 2 == 0 else order[::-1]:
            out.extend(step(model, ids, o) for _ in range(args.steps))
    sent = off.stats.bytes_offloaded
    split = None
    if args.phases:
        split = {
            "none": phases(model, ids, None, args.phases),
            "one": phases(model, ids, off, args.phases),
        }
    traced = None
    if seq in args.trace:
        from torch.profiler import ProfilerActivity, profile

        from benchmarks.diagnostics.trace_plan import analyse

        traced = {}
        for name, o in (("none", None), ("one", off)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(model, ids, o)
            traced[name] = analyse(prof, gaps=6)
    return {
        "seq": seq,
        "none_ms": none,
        "one_ms": one,
        "none_ms_median": statistics.median(none),
        "one_ms_median": statistics.median(one),
        "ratio": statistics.median(one) / statistics.median(none),
        "spread": max(none) / min(none) - 1.0,
        "bytes_offloaded": sent,
        "peak_none": peak(model, ids, None),
        "peak_one": peak(model, ids, off),
        "trace": traced,
        "phases": split,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,3072,4096,5120,6144,7168,8192")
    p.add_argument("--blocks", type=int, default=4, help="blocks each way")
    p.add_argument("--steps", type=int, default=2, help="steps per block")
    p.add_argument("--trace", default="", help="lengths (of --lengths) to profile one step at")
    p.add_argument("--phases", type=int, default=0, help="steps each way timed in parts (0: none)")
    p.add_argument("--out", default=None, help="JSON output file")
    args = p.parse_args(argv)
    try:
        args.lengths = [int(s) for s in args.lengths.split(",")]
        args.trace = [int(s) for s in args.trace.split(",") if s.strip()]
    except ValueError:
        p.error(
            f"--lengths, --trace: comma-separated integers, got {args.lengths!r}, {args.trace!r}"
        )
    if not set(args.trace) <= set(args.lengths):
        p.error(f"--trace {args.trace}: each length must be one of --lengths {args.lengths}")
    if min(args.lengths) < 1 or args.blocks < 1 or args.steps < 1 or args.phases < 0:
        p.error("--lengths, --blocks and --steps >= 1, --phases >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("one_layer.py needs a CUDA device")
    model = llama_1b(max(args.lengths), "cuda")
    off = offload.ActivationOffloader(offload.find_layers(model), offload_layers=1)
    rows = [measure(model, off, seq, args) for seq in args.lengths]
    off.close()
    print(
        f"{'seq':>6s} {'none ms':>8s} {'one ms':>8s} {'ratio':>6s} {'spread':>6s} {'MiB sent':>9s}"
    )
    for r in rows:
        print(
            f"{r['seq']:6d} {r['none_ms_median']:8.2f} {r['one_ms_median']:8.2f} "
            f"{r['ratio']:6.3f} {r['spread']:6.3f} {r['bytes_offloaded'] / 2**20:9.1f}"
        )
        for name, ph in (r["phases"] or {}).items():
            print(
                f"{'':6s} {name}: "
                + ", ".join(f"{k} {ph[k]:.2f} (host {ph['host_' + k]:.2f})" for k in PHASES)
                + " ms"
            )
        for name, t in (r["trace"] or {}).items():
            print(
                f"{'':6s} {name}: device {t['device_ms']:.1f} ms, compute busy "
                f"{t['compute_busy_ms']:.1f}, idle {t['compute_idle_ms']:.1f}; D2H "
                f"{t['d2h_busy_ms']:.1f}, H2D {t['h2d_busy_ms']:.1f} ms; largest gaps "
                + ", ".join(f"{g['ms']:.2f} at {g['at_ms']:.1f}" for g in t["largest_gaps"][:3])
                + f"; slow host calls {len(t['slow_runtime_calls'])}"
            )
    if args.out:
        out = {
            "benchmark": "one_layer",
            "command": sys.argv,
            "settings": vars(args),
            "environment": environment(torch.device("cuda")),
            "rows": rows,
        }
        write_json(args.out, out)


if __name__ == "__main__":
    main()
