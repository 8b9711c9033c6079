"""What ``offload_layers="auto"`` does step by step when every step has a new length.

Command (one H200, about a minute)::

    PYTHONPATH=. python3 benchmarks/diagnostics/new_lengths.py --out new_lengths.json

Model: ``benchmarks._common.llama_1b_config`` (HF Llama ~1.1B, SDPA, bf16, random
weights, batch 1). The loop of ``tests/activations/auto/test_auto_cuda.py``: each step draws a length
from ``--min``..``--max`` (``--seed``); a step without offloading takes the shape's first
step (kernel selection, allocator growth), then one step with the default offloader
(``"auto"``), one with ``offload_layers=1`` (the least offloading moves) and two without
offloading, whose median each ratio is taken against (their spread: ``noise``).

Per step: what "auto" ran (``probe``: a measuring step; ``plan``: its choice; ``none``:
nothing offloaded), layers offloaded and chosen, both ratios, the scale and phase of its
policy, the pinned bytes its host pool added in the step (pinning mid-step costs more
than the step), and the host milliseconds of the policy's and the offloader's functions
in the step (``perf_counter`` wrappers, about 0.1 us per call). The device time of a
step includes the host's where the device waited for it (steps up to about 4k tokens
are paced by the host).
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
from collections.abc import Sequence
from typing import Any

import torch

import offload
from benchmarks._common import hf_step, llama_1b, results, time_methods
from offload.activations import _saves, _step
from offload.activations._auto import _family as _auto_family
from offload.activations._auto import _fit as _auto_fit
from offload.activations._auto import _policy as _auto_policy
from offload.activations._auto import _probe as _auto_probe
from offload.activations._control import Internals

TIMED: list[tuple[Any, list[str]]] = [
    (_auto_policy.AutoPolicy, ["prepare", "_collect", "_measured", "_decide"]),
    (_auto_family.Family, ["sized", "base"]),
    (_auto_probe.Probe, ["result", "opened", "closed", "_at"]),
    (_auto_probe.StepWatch, ["opened", "closed", "_backward_ended"]),
    (_auto_fit.ShapeModel, ["_fit"]),
    (_saves.Saves, ["pack", "_place"]),
    (_step.Step, ["open_group", "close_group", "finish_forward"]),
]


def _pool_bytes(off: Any) -> int:
    pool = Internals(off).runtime.pool_if_made
    return 0 if pool is None else pool.reserved_bytes


def run(model: Any, args: argparse.Namespace) -> list[dict]:
    layers = offload.find_layers(model)
    auto = offload.ActivationOffloader(layers)  # the default: "auto"
    if args.device != "cuda":
        Internals(auto).use_meter(_auto_probe.Meter())  # the host clock, no memory gauge
    one = offload.ActivationOffloader(layers, offload_layers=1)
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    gen = torch.Generator(args.device).manual_seed(args.seed)
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    rows = []
    try:
        for _ in range(2):  # kernels and allocator warm, as in any run past its first steps
            warm = torch.randint(0, vocab, (1, args.min), device=args.device, generator=gen)
            hf_step(model, warm)
            hf_step(model, warm, one)
        restore = time_methods(TIMED, calls)
        try:
            for i in range(args.steps):
                seq = rng.randint(args.min, args.max)
                ids = torch.randint(0, vocab, (1, seq), device=args.device, generator=gen)
                hf_step(model, ids)  # the shape's first step
                before = {k: v[1] for k, v in calls.items()}
                pool = _pool_bytes(auto)
                auto_ms = hf_step(model, ids, auto)[1]
                host = {
                    k: round((v[1] - before.get(k, 0.0)) * 1e3, 3)
                    for k, v in calls.items()
                    if v[1] != before.get(k, 0.0)
                }
                grew = _pool_bytes(auto) - pool
                stats = dict(auto.stats.auto)
                one_ms = hf_step(model, ids, one)[1]
                none = [hf_step(model, ids)[1] for _ in range(2)]
                mid = statistics.median(none)
                rows.append(
                    {
                        "step": i,
                        "tokens": seq,
                        "run": stats.get("step"),
                        "offloaded": len(stats.get("offloaded") or []),
                        "chosen": len(stats.get("chosen") or []),
                        "ratio": auto_ms / mid,
                        "one_layer_ratio": one_ms / mid,
                        "none_ms": mid,
                        "noise": max(none) / min(none) - 1.0,
                        "phase": stats.get("phase"),
                        "scale": stats.get("scale"),
                        "predicted_ratio": stats.get("predicted_ratio"),
                        "pool_added_bytes": grew,
                        "host_ms": host,
                        "state": auto.last_step.auto_state.state_size,
                    }
                )
        finally:
            restore()
    finally:
        auto.close()
        one.close()
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--min", type=int, default=2048, help="shortest length (tokens)")
    p.add_argument("--max", type=int, default=8192, help="longest length (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 4-layer model of hidden 64 (smoke)")
    p.add_argument("--out", default=None, help="JSON output file")
    args = p.parse_args(argv)
    if args.steps < 1 or not 1 <= args.min <= args.max:
        p.error("--steps >= 1 and 1 <= --min <= --max")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model = llama_1b(args.max, args.device, args.tiny)
    rows = run(model, args)
    print(" step tokens run   off/chosen  ratio  one   noise  pool+MiB  policy host ms")
    for r in rows:
        policy = r["host_ms"].get("AutoPolicy.prepare", 0.0)
        print(
            f" {r['step']:4d} {r['tokens']:6d} {r['run'] or '-':5s} "
            f"{r['offloaded']:3d}/{r['chosen']:<3d}     {r['ratio']:5.3f}  "
            f"{r['one_layer_ratio']:5.3f} {r['noise']:5.3f}  {r['pool_added_bytes'] >> 20:7d}  "
            f"{policy:7.2f}"
        )
    return results("new_lengths", args, rows)


if __name__ == "__main__":
    main()
