"""Host time of the offloader's functions inside a real forward, per call.

Command (one GPU, about 15 s)::

    PYTHONPATH=. python3 benchmarks/diagnostics/host_calls.py --plans o.......,oo......,o.Ss.... \\
        --out host_calls.json

``bench_hooks.py`` times the hooks in a tight loop; this times them where they run: in
ref-8L's forward (``ReferenceModel(8, 4096, 32, 14336)``, bf16), where the device's
kernels and copies run beside them and the host's caches are cold. The offloader's
functions (``Step.pack`` and what it calls, the backends' ``d2h``, the host pool, the
layer hooks, ``__enter__``/``__exit__``; with ``--compress fp8`` the staging slots and the
codec's entry points and kernel launches) are wrapped with ``time.perf_counter`` (about
0.1 us per call added); per plan (lever codes as in ``trace_layers.py``) the forward's
host time (no synchronisation inside it), the host time from the forward's start to
the second layer's pre-hook (the first layer's whole host cost), and per function the
calls per step, us per call and ms per step, medians over 5 steps after 3 warm-up.
``........`` (no lever) is measured first.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from typing import Any

import torch

import offload
from benchmarks._common import environment, levers_of, time_methods, write_json
from offload import _compress, _device, _host_pool, _step, activations
from offload.models import ReferenceModel

TIMED: list[tuple[Any, list[str]]] = [
    (_step.Step, ["pack", "_place", "_copy", "_flush_d2h", "open_group", "close_group"]),
    (_step.Step, ["_release", "finish_forward"]),
    (_host_pool.HostPool, ["allocate"]),
    (_device.CudaBackend, ["d2h", "h2d", "wait", "record_d2h"]),
    (_device._Staging, ["slot"]),
    (_compress, ["quantize_into", "dequantize_into", "_launch_quantize", "_launch_dequantize"]),
    (activations.ActivationOffloader, ["_layer_start", "_layer_end", "__enter__", "__exit__"]),
]

calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="o.......,oo......,o.Ss....")
    parser.add_argument("--compress", choices=["fp8"], default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    time_methods(TIMED, calls)
    torch.manual_seed(0)
    model = ReferenceModel(8, 4096, 32, 14336, device="cuda", dtype=torch.bfloat16)
    steps, warmup = 5, 3
    result: dict[str, Any] = {}
    for code in ["........", *args.plans.split(",")]:
        plan = offload.Plan(model.layers, levers_of(code), compress=args.compress).apply(model)
        at_layer1 = [0.0]
        hook = model.layers[1].register_forward_pre_hook(
            lambda _m, _a, box=at_layer1: box.__setitem__(0, time.perf_counter())
        )
        forward, first_layer = [], []
        try:
            for i in range(warmup + steps):
                if i == warmup:
                    calls.clear()
                x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = model.loss(x)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                loss.backward()
                torch.cuda.synchronize()
                if i >= warmup:
                    forward.append((t1 - t0) * 1e3)
                    first_layer.append((at_layer1[0] - t0) * 1e3)
        finally:
            hook.remove()
            plan.remove()
        per_call = {
            k: {
                "calls_per_step": n / steps,
                "us_per_call": s / n * 1e6,
                "ms_per_step": s / steps * 1e3,
            }
            for k, (n, s) in sorted(calls.items(), key=lambda kv: -kv[1][1])
        }
        result[code] = {
            "forward_host_ms": statistics.median(forward),
            "first_layer_host_ms": statistics.median(first_layer),
            "functions": per_call,
        }
        print(
            f"{code}: forward host {result[code]['forward_host_ms']:.2f} ms, first layer "
            f"{result[code]['first_layer_host_ms']:.2f} ms"
        )
        for k, v in per_call.items():
            print(
                f"   {k:36s} calls/step {v['calls_per_step']:6.1f}  us/call "
                f"{v['us_per_call']:7.1f}  ms/step {v['ms_per_step']:6.3f}"
            )
    write_json(
        args.out,
        {
            "benchmark": "host_calls",
            "command": sys.argv,
            "environment": environment(torch.device("cuda")),
            "plans": result,
        },
    )


if __name__ == "__main__":
    main()
