"""Where a plan's step time goes: one profiled ref-8L step per plan, and its stalls.

Command (one GPU, about 30 s)::

    PYTHONPATH=. python3 benchmarks/diagnostics/trace_plan.py --plans cccccccc,ccccccc.,CCCCCCC. \
        --out trace_plan.json

Each plan is a string of one lever code per layer (``o`` offload, ``S``
selective_offload, ``s`` selective, ``c`` checkpoint, ``C`` checkpoint_offload, ``i``
selective_offload_inputs, ``.`` keep), applied with :class:`offload.Plan` (``--compress
fp8``: its offloaded layers compressed) around ref-8L's forward. Per plan: the median step time of ``--steps`` steps
(CUDA events, after 3 warm-up steps, the caching allocator emptied first), then one step
under ``torch.profiler``. From the profile: ``device ms`` (first kernel start to last
kernel end); ``backward from`` (where a 1-cycle ``torch.cuda._sleep`` kernel queued
between the forward and the backward ran); ``compute busy`` (union of the compute
stream's kernels: the stream with the most kernel time); ``compute idle`` (device ms -
compute busy: the time the compute stream waited, for the host, for a copy or for an
event); the copy streams' busy time (D2H and H2D, from the memcpy kinds); the ``--gaps``
largest idle gaps of the compute stream (start in ms from the first kernel, length, and
how long host-to-device copies ran during the gap); and every CUDA runtime call of the
host that took over 100 us (``cudaMalloc``, ``cudaHostAlloc``, a synchronisation: the
usual reasons for the compute stream to starve).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from typing import Any

import torch

import offload
from benchmarks._common import environment, levers_of, union_length, write_json
from offload.models import ReferenceModel


def analyse(prof: Any, gaps: int) -> dict[str, Any]:
    """Per-stream busy times and the compute stream's largest idle gaps (us -> ms)."""
    from torch.autograd import DeviceType

    kernels: dict[int, list[tuple[float, float]]] = defaultdict(list)
    slow_calls: list[tuple[float, float, str]] = []  # host runtime calls over 100 us
    copies: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    marker = None
    for e in prof.events():
        a, b = e.time_range.start, e.time_range.end
        if e.device_type != DeviceType.CUDA:
            if e.name.startswith("cuda") and b - a > 100:
                slow_calls.append((a, b - a, e.name))
            continue
        if e.name.startswith("Memcpy"):
            kind = "h2d" if "HtoD" in e.name else "d2h" if "DtoH" in e.name else "other"
            copies[kind].append((a, b, 0))
        elif not e.name.startswith("Memset"):
            kernels[e.device_resource_id].append((a, b))
            if "spin" in e.name:  # torch.cuda._sleep's kernel
                marker = a
    compute = max(kernels, key=lambda s: union_length(kernels[s]))
    spans = sorted(kernels[compute])
    first = min(a for a, _ in spans)
    last = max(b for _, b in spans)
    busy = union_length(spans)
    idle: list[tuple[float, float]] = []
    end = spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            idle.append((end, a))
        end = max(end, b)
    idle.sort(key=lambda g: g[0] - g[1])
    h2d = copies.get("h2d", [])
    top = []
    for a, b in idle[:gaps]:
        overlap = sum(min(b, y) - max(a, x) for x, y, _ in h2d if x < b and y > a)
        top.append(
            {"at_ms": (a - first) / 1e3, "ms": (b - a) / 1e3, "h2d_overlap_ms": overlap / 1e3}
        )
    return {
        "device_ms": (last - first) / 1e3,
        "backward_at_ms": None if marker is None else (marker - first) / 1e3,
        "compute_busy_ms": busy / 1e3,
        "compute_idle_ms": (last - first - busy) / 1e3,
        "idle_gaps_over_50us_ms": sum(b - a for a, b in idle if b - a > 50) / 1e3,
        "d2h_busy_ms": union_length([(a, b) for a, b, _ in copies.get("d2h", [])]) / 1e3,
        "h2d_busy_ms": union_length([(a, b) for a, b, _ in h2d]) / 1e3,
        "largest_gaps": top,
        "slow_runtime_calls": [
            {"at_ms": (a - first) / 1e3, "ms": d / 1e3, "name": n} for a, d, n in sorted(slow_calls)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="........,cccccccc,ccccccc.,CCCCCCC.,CCCCCCCC")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--gaps", type=int, default=8)
    parser.add_argument("--compress", choices=["fp8"], default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ReferenceModel(8, 4096, 32, 14336, device="cuda", dtype=torch.bfloat16)

    def step(mark: bool = False) -> None:
        x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
        loss = model.loss(x)
        if mark:  # a 1-cycle kernel on the compute stream where the backward starts
            torch.cuda._sleep(1)
        loss.backward()

    rows: dict[str, Any] = {}
    for code in args.plans.split(","):
        levers = levers_of(code)
        torch.cuda.empty_cache()
        plan = offload.Plan(model.layers, levers, compress=args.compress).apply(model)
        try:
            for _ in range(3):
                step()
            times = []
            for _ in range(args.steps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(mark=True)
                torch.cuda.synchronize()
        finally:
            plan.remove()
        row = {"step_ms": times, "step_ms_median": statistics.median(times)}
        row |= analyse(prof, args.gaps)
        rows[code] = row
        print(
            f"{code}: step {row['step_ms_median']:.1f} ms; traced device {row['device_ms']:.1f}, "
            f"compute busy {row['compute_busy_ms']:.1f}, idle {row['compute_idle_ms']:.1f} "
            f"(gaps > 50 us {row['idle_gaps_over_50us_ms']:.1f}); D2H {row['d2h_busy_ms']:.1f}, "
            f"H2D {row['h2d_busy_ms']:.1f} ms; backward from {row['backward_at_ms']:.1f} ms",
            flush=True,
        )
        for g in row["largest_gaps"]:
            print(
                f"    gap at {g['at_ms']:.1f} ms: {g['ms']:.2f} ms "
                f"(H2D running {g['h2d_overlap_ms']:.2f} ms of it)"
            )
        for c in row["slow_runtime_calls"]:
            print(f"    host call at {c['at_ms']:.1f} ms: {c['name']} {c['ms']:.2f} ms")
    write_json(
        args.out,
        {
            "benchmark": "trace_plan",
            "command": sys.argv,
            "environment": environment(torch.device("cuda")),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
