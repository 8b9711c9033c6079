"""Eager and CUDA-graphed training steps, with and without activation offloading.

One process, one model, rows in this order: the eager step without offloading, the
eager step offloading each ``k``, the step captured whole in one CUDA graph
(``torch.cuda.graph``, forward and backward) without offloading, and the graphed step
offloading each ``k`` (the offloader entered inside the capture). A graphed row is
timed as ``graph.replay()``; every row reports the median step time over ``--steps``
timed steps after ``--warmup`` (CUDA events), its ratio to the eager and to the graphed
step without offloading, and the peak device memory above the weights and the input
(eager: ``max_memory_allocated`` over a step; graphed: over the capture, which is the
memory the graph's pool keeps). Gradients of the first replay of each graphed row are
compared bitwise with the eager step's.

    PYTHONPATH=. python3 benchmarks/graphs/bench_graphs.py --preset tiny48 \\
        --out benchmarks/results/graphs_tiny48.json
    PYTHONPATH=. python3 benchmarks/graphs/bench_graphs.py --preset ref-8L --ks 1,2 \\
        --out benchmarks/results/graphs_ref8l.json
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import offload
from benchmarks._common import GIB, environment, median, write_json
from benchmarks.activations.bench_activations import DTYPE, PRESETS, Block, loss_of


def _k(text: str) -> int | str:
    return text if text in ("auto", "all") else int(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny48")
    parser.add_argument(
        "--ks",
        default=None,
        help="comma-separated offload_layers (ints, 'all', 'auto'); "
        "default: tiny48 'auto,all', ref-8L '1,2'",
    )
    parser.add_argument("--steps", type=int, default=15, help="timed steps per row (>= 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row (>= 2)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 5:
        parser.error(f"--steps must be >= 5; got {args.steps}")
    if args.warmup < 2:
        parser.error(f"--warmup must be >= 2 ('auto' measures one step); got {args.warmup}")
    default = "auto,all" if args.preset == "tiny48" else "1,2"
    args.ks = [_k(k) for k in (args.ks or default).split(",")]
    return args


class Model:
    def __init__(self, preset: str, layers: int | None) -> None:
        cfg = PRESETS[preset][0]
        if layers is not None:
            import dataclasses

            cfg = dataclasses.replace(cfg, layers=layers)
        self.cfg = cfg
        dev = torch.device("cuda")
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(cfg, dev) for _ in range(cfg.layers))
        self.x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, device=dev, dtype=DTYPE)

    def zero(self) -> None:
        for p in self.layers.parameters():
            p.grad = None

    def step(self, off: offload.ActivationOffloader | None) -> None:
        self.zero()
        if off is None:
            h = self.x
            for layer in self.layers:
                h = layer(h)
        else:
            with off:
                h = self.x
                for layer in self.layers:
                    h = layer(h)
        loss_of(h).backward()

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.layers.parameters()]


def _timed(fn: Any, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _offloader(model: Model, k: int | str) -> offload.ActivationOffloader:
    return offload.ActivationOffloader(model.layers, offload_layers=k)


def eager_row(model: Model, k: int | str | None, steps: int, warmup: int) -> dict[str, Any]:
    off = None if k is None else _offloader(model, k)
    times = _timed(lambda: model.step(off), steps, warmup)
    model.zero()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.step(off)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    row = _row("eager", k, times, peak, off)
    grads = model.grads()
    if off is not None:
        off.close()
    return row | {"_grads": grads}


def graphed_row(model: Model, k: int | str | None, steps: int, warmup: int) -> dict[str, Any]:
    off = None if k is None else _offloader(model, k)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):  # 'auto' measures the first of these, decides at the second
            model.step(off)
    torch.cuda.current_stream().wait_stream(side)
    model.zero()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.step(off)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    graph.replay()
    grads = model.grads()
    times = _timed(graph.replay, steps, 2)
    row = _row("graphed", k, times, peak, off)
    del graph
    model.zero()
    if off is not None:
        off.close()
    return row | {"_grads": grads}


def _row(mode: str, k: Any, times: list[float], peak: int, off: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "mode": mode,
        "k": k,
        "name": f"{mode} " + ("no offload" if k is None else f"offload k={k}"),
        "ms": median(times),
        "times_ms": times,
        "peak_gib": peak / GIB,
    }
    if off is not None:
        stats = off.stats
        row.update(
            offloaded_layers=sum(1 for s in stats.layers if s.bytes_offloaded),
            bytes_offloaded=stats.bytes_offloaded,
            host_pool_bytes=stats.host_pool_bytes,
            auto=stats.auto,
        )
    return row


def _grads_text(equal: bool | None) -> str:
    if equal is None:
        return "n/a (the eager control differs from itself)"
    return "bitwise" if equal else "DIFFERENT"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_graphs.py needs a CUDA GPU")
    model = Model(args.preset, args.layers)
    rows = [eager_row(model, None, args.steps, args.warmup)]
    want = rows[0].pop("_grads")
    # control: is the eager step itself bitwise reproducible here? (without
    # torch.use_deterministic_algorithms, attention's backward may not be)
    model.step(None)
    deterministic = all(torch.equal(a, b) for a, b in zip(model.grads(), want))
    rows += [eager_row(model, k, args.steps, args.warmup) for k in args.ks]
    # a first capture allocates the capture stream's cuBLAS and attention workspaces, so
    # that no graphed row's peak includes them
    graphed_row(model, None, 5, args.warmup)
    rows.append(graphed_row(model, None, args.steps, args.warmup))
    rows += [graphed_row(model, k, args.steps, args.warmup) for k in args.ks]
    eager_none, graphed_none = rows[0]["ms"], rows[1 + len(args.ks)]["ms"]
    for row in rows:
        grads = row.pop("_grads", None)
        if grads is not None:
            row["grads_equal_eager"] = (
                all(torch.equal(a, b) for a, b in zip(grads, want)) if deterministic else None
            )
        row["x_eager_none"] = row["ms"] / eager_none
        row["x_graphed_none"] = row["ms"] / graphed_none
        gc.collect()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, preset {args.preset} {model.cfg}")
    print(f"{'row':<28}{'ms':>9}{'x eager':>9}{'x graph':>9}{'peak GiB':>10}{'layers':>8}  grads")
    for r in rows:
        print(
            f"{r['name']:<28}{r['ms']:>9.2f}{r['x_eager_none']:>9.3f}{r['x_graphed_none']:>9.3f}"
            f"{r['peak_gib']:>10.3f}{r.get('offloaded_layers', 0):>8}  "
            f"{_grads_text(r.get('grads_equal_eager', True))}"
        )
    if args.out:
        write_json(
            args.out,
            {
                "benchmark": "bench_graphs",
                "preset": args.preset,
                "model": vars(model.cfg),
                "steps": args.steps,
                "warmup": args.warmup,
                "eager_deterministic": deterministic,
                "environment": environment(dev),
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
