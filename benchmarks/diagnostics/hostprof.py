"""Where the host time of an offloaded step goes: cProfile of a few steps.

Command (one CUDA GPU or the CPU)::

    PYTHONPATH=. python3 benchmarks/diagnostics/hostprof.py --offload-layers 0 --top 25
    PYTHONPATH=. python3 benchmarks/diagnostics/hostprof.py --offload-layers all --top 25

Model: the tiny48 preset of bench_activations.py (48 Llama-style layers, hidden 256,
4 heads, ffn 704, seq 256, batch 4, bf16 on CUDA), a launch-bound model where the
offloader's Python work is what sets the step time. Prints the step time without and
with the offloader (medians of ``--steps`` after warm-up, host clock with a device
synchronisation at each end) and the ``--top`` functions by own time over ``--steps``
profiled steps.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import offload  # noqa: E402
from offload.models import ReferenceModel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--offload-layers", default="0", help="0, all, auto or an int")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seq, batch = (256, 4) if cuda else (32, 1)
    model = ReferenceModel(48, 256, 4, 704, device=dev, dtype=dtype)
    x = torch.randn(batch, seq, 256, device=dev, dtype=dtype)
    sel = args.offload_layers
    sel = int(sel) if sel.isdigit() else sel
    off = offload.ActivationOffloader(model.layers, offload_layers=sel)

    def step(ctx) -> float:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with ctx:
            loss = model.loss(x)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    for ctx in (contextlib.nullcontext, lambda: off):
        for _ in range(3):
            step(ctx())
    none = statistics.median(step(contextlib.nullcontext()) for _ in range(args.steps))
    with_ = statistics.median(step(off) for _ in range(args.steps))
    stats = off.stats
    print(
        f"{dev}: none {none:.1f} ms, offload_layers={sel!r} {with_:.1f} ms "
        f"({with_ / none:.2f}x); offloaded {stats.bytes_offloaded / 2**20:.1f} MiB in "
        f"{sum(1 for la in stats.layers if la.offloaded)} layers"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step(off)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
