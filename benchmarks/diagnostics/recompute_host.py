"""Host and device time of recompute on an HF Llama ~1.1B step: torch's non-reentrant
checkpoint against the planner's ``checkpoint`` lever, and its ``selective`` lever.

Command (one H200, about a minute)::

    PYTHONPATH=. python3 benchmarks/diagnostics/recompute_host.py --out recompute_host.json

Configurations, each on every decoder layer or on the first ``--some`` of them:
no lever; Hugging Face gradient checkpointing (``torch.utils.checkpoint``,
non-reentrant); ``offload.Plan`` with ``checkpoint`` and with ``checkpoint_offload``, both
``recompute="reentrant"`` (Note [full recompute] in ``offload/_recompute/_reentrant.py``), and
with ``selective`` (torch's non-reentrant checkpoint with the lever's two dispatch modes). ``--rounds`` rounds
of blocks of ``--steps`` steps (one warm-up step per block), each round in the reverse
order of the one before. Per configuration: the median device ms (CUDA events after a
synchronisation), the median host ms (from the call to the return of ``backward()``,
before any synchronisation: the device waits for the host where the two are close), the ratio to no lever and the activation peak. Before
the timing, each configuration's loss and gradients are compared with no lever's
(``torch.equal``, deterministic algorithms; the row "none" is the control, the step
against itself).

``--profile NAME`` (repeatable): afterwards, ``--steps`` steps of configuration ``NAME``
under cProfile; the JSON's ``profiles`` hold its ``--top`` functions by own time
(milliseconds per step), CUDA calls among them.

``--tiny``: a 4-layer model of hidden 64 on the CPU (host clock only): the script's
check, and the host cost of each lever where the host does all the work.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
from collections.abc import Callable
from typing import Any

import torch

import offload
from benchmarks._common import environment, hf_step, llama_1b, write_json


def configs(model: Any, some: int) -> dict[str, Callable[[], Callable[[], None]]]:
    layers = offload.find_layers(model)
    L = len(layers)

    def hf(n: int) -> Callable[[], Callable[[], None]]:
        def install() -> Callable[[], None]:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            for i, layer in enumerate(layers):
                layer.gradient_checkpointing = i < n
            return model.gradient_checkpointing_disable

        return install

    def plan(lever: str, n: int) -> Callable[[], Callable[[], None]]:
        def install() -> Callable[[], None]:
            p = offload.Plan(layers, [lever] * n + ["keep"] * (L - n), recompute="reentrant")
            return p.apply(model).remove

        return install

    out: dict[str, Callable[[], Callable[[], None]]] = {"none": lambda: lambda: None}
    for n in (L, some):
        out[f"hf checkpointing x{n}"] = hf(n)
        out[f"checkpoint x{n}"] = plan("checkpoint", n)
        out[f"checkpoint_offload x{n}"] = plan("checkpoint_offload", n)
        out[f"selective x{n}"] = plan("selective", n)
    return out


def profile(
    model: Any, ids: torch.Tensor, install: Callable[[], Callable[[], None]], steps: int, top: int
) -> list[dict[str, Any]]:
    """The ``top`` functions by own time over ``steps`` profiled steps (after a warm-up
    step) of one configuration: milliseconds per step, own and cumulative."""
    undo = install()
    try:
        hf_step(model, ids)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            hf_step(model, ids)
        prof.disable()
    finally:
        undo()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [
        {
            "function": f"{os.path.basename(file)}:{line}({name})",
            "calls_per_step": round(nc / steps, 1),
            "own_ms": round(tt * 1e3 / steps, 3),
            "cum_ms": round(ct * 1e3 / steps, 3),
        }
        for (file, line, name), (_, nc, tt, ct, _) in stats.items()
    ]
    rows.sort(key=lambda r: -r["own_ms"])
    for r in rows[:top]:
        print(
            f"  {r['own_ms']:8.3f} {r['cum_ms']:8.3f} {r['calls_per_step']:7.1f}  {r['function']}"
        )
    return rows[:top]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--some", type=int, default=8, help="layers of the partial configurations")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", action="append", default=[], help="a configuration to profile")
    ap.add_argument("--top", type=int, default=30, help="functions kept per profile")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    model = llama_1b(args.seq, device, tiny=args.tiny)
    seq = 64 if args.tiny else args.seq
    some = min(args.some, len(offload.find_layers(model)))
    gen = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device, generator=gen)
    table = configs(model, some)

    ref_loss, _ = hf_step(model, ids)
    ref = [p.grad.clone() for p in model.parameters()]
    bitwise: dict[str, bool] = {}  # "none" is the control: the step against itself
    for name, install in table.items():
        undo = install()
        try:
            loss, _ = hf_step(model, ids)
            bitwise[name] = torch.equal(loss, ref_loss) and all(
                torch.equal(a, p.grad) for a, p in zip(ref, model.parameters())
            )
        finally:
            undo()
    del ref

    names = list(table)
    device_ms: dict[str, list[float]] = {n: [] for n in names}
    host_ms: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            undo = table[name]()
            try:
                hf_step(model, ids)  # warm-up
                for _ in range(args.steps):
                    if device == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        before = torch.cuda.memory_allocated()
                    _, ms = hf_step(model, ids, host=host_ms[name])
                    device_ms[name].append(ms)
                    if device == "cuda":
                        peaks[name] = torch.cuda.max_memory_allocated() - before
            finally:
                undo()
    none = statistics.median(device_ms["none"])
    rows = []
    for name in names:
        dev = statistics.median(device_ms[name])
        rows.append(
            {
                "config": name,
                "device_ms": round(dev, 2),
                "host_ms": round(statistics.median(host_ms[name]), 2),
                "ratio": round(dev / none, 4),
                "peak_gib": round(peaks[name] / 2**30, 3) if name in peaks else None,
                "bitwise": bitwise[name],
                "device_all_ms": [round(x, 2) for x in device_ms[name]],
                "host_all_ms": [round(x, 2) for x in host_ms[name]],
            }
        )
        print(
            f"{name:28s} device {dev:8.2f} ms  host {rows[-1]['host_ms']:8.2f} ms  "
            f"x{rows[-1]['ratio']:.3f}  peak {rows[-1]['peak_gib']} GiB  bitwise {bitwise[name]}",
            flush=True,
        )
    result = {
        "benchmark": "recompute_host",
        "settings": vars(args),
        "environment": environment(torch.device(device)),
        "rows": rows,
        "profiles": {n: profile(model, ids, table[n], args.steps, args.top) for n in args.profile},
    }
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
