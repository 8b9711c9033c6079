"""When each layer's forward and backward starts, on the device, for a few plans.

Command (one GPU, about 20 s)::

    PYTHONPATH=. python3 benchmarks/diagnostics/trace_layers.py --plans o.......,oo......,o.Ss.... \\
        --out trace_layers.json

Model: ref-8L (``ReferenceModel(8, 4096, 32, 14336)``, bf16, seed 0); a step is
``model.loss(x).backward()`` on a fresh ``x``. Each plan is a string of lever codes
(``o`` offload, ``S`` selective_offload, ``s`` selective, ``c`` checkpoint, ``C``
checkpoint_offload, ``i`` selective_offload_inputs, ``.`` keep) applied with :class:`offload.Plan` (with ``--compress
fp8``, its offloaded layers' copies are compressed), each after
``gc.collect()`` and ``torch.cuda.empty_cache()``; ``........`` (no
lever) is always measured first, as the reference. Per step, CUDA events are recorded on
the compute stream at the step's start, at each layer's forward pre-hook (``f<i>``),
when the gradient of each layer's output arrives (``b<i>``: that layer's backward
starts), at the end of the forward and at the end of the backward. Printed per plan:
the median over ``--steps`` steps (after 3 warm-up steps) of each mark in ms from the
start, and in parentheses its difference from the no-lever plan: where a plan's extra
time appears (a mark's delta grows across a layer: that layer took longer). Also
``d<n>``: when the n-th event the offloader records on its D2H stream in the step
completes (``CudaBackend.record_d2h``, timed here by wrapping it). With plain
``offload`` levers there is one per offloaded layer call, at its close, in order: it
completes when that call's copies have all landed, and the call's release waits for it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

import offload
from benchmarks._common import environment, free_cached, levers_of, write_json
from offload import _device
from offload.models import ReferenceModel

_d2h_events: list[torch.cuda.Event] = []
_record_d2h = _device.CudaBackend.record_d2h


def _timed_record_d2h(self: _device.CudaBackend) -> torch.cuda.Event:
    """``CudaBackend.record_d2h`` with a timing event, kept for this step's marks."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(self.d2h_stream)
    _d2h_events.append(event)
    return event


def marks(
    model: ReferenceModel, code: str, steps: int, compress: str | None = None
) -> dict[str, float]:
    """Median ms from the step's start to each mark, for the plan ``code``."""
    free_cached(torch.device("cuda"))  # each plan starts from the same allocator state
    plan = offload.Plan(model.layers, levers_of(code), compress=compress).apply(model)
    rows: list[dict[str, float]] = []
    try:
        for i in range(steps + 3):
            events: list[tuple[str, torch.cuda.Event]] = []

            def mark(name: str, events: list = events) -> None:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                events.append((name, e))

            def pre(_m: Any, _a: Any, i: int) -> None:
                mark(f"f{i}")

            def post(_m: Any, _a: Any, out: torch.Tensor, i: int) -> None:
                out.register_hook(lambda _g: mark(f"b{i}"))

            hooks = []
            for j, layer in enumerate(model.layers):
                hooks.append(layer.register_forward_pre_hook(lambda m, a, j=j: pre(m, a, j)))
                hooks.append(layer.register_forward_hook(lambda m, a, o, j=j: post(m, a, o, j)))
            x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            _d2h_events.clear()
            mark("start")
            loss = model.loss(x)
            mark("forward_end")
            loss.backward()
            mark("end")
            torch.cuda.synchronize()
            for h in hooks:
                h.remove()
            t0 = events[0][1]
            if i >= 3:
                row = {name: t0.elapsed_time(e) for name, e in events}
                row.update({f"d{g}": t0.elapsed_time(e) for g, e in enumerate(_d2h_events)})
                rows.append(row)
    finally:
        plan.remove()
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="o.......,oo......,o.Ss....")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument(
        "--compress", choices=["fp8"], default=None, help="the plans' compress setting"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ReferenceModel(8, 4096, 32, 14336, device="cuda", dtype=torch.bfloat16)
    _device.CudaBackend.record_d2h = _timed_record_d2h  # type: ignore[method-assign]
    base = marks(model, "........", args.steps)
    rows = {"........": base}
    print("........ " + " ".join(f"{k}:{v:.1f}" for k, v in base.items()))
    for code in args.plans.split(","):
        r = rows[code] = marks(model, code, args.steps, args.compress)
        print(
            code
            + " "
            + " ".join(
                f"{k}:{v:.1f}({v - base[k]:+.1f})" if k in base else f"{k}:{v:.1f}"
                for k, v in r.items()
            )
        )
    write_json(
        args.out,
        {
            "benchmark": "trace_layers",
            "command": sys.argv,
            "environment": environment(torch.device("cuda")),
            "steps": args.steps,
            "compress": args.compress,
            "marks_ms": rows,
        },
    )


if __name__ == "__main__":
    main()
