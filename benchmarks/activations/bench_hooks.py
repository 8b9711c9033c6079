"""Host cost of the offloader's saved-tensor hooks, in microseconds per saved tensor.

Command (CPU, then CUDA when a GPU is present; about a minute on a CPU)::

    PYTHONPATH=. python3 benchmarks/activations/bench_hooks.py --out benchmarks/results/hooks.json
    PYTHONPATH=. python3 benchmarks/activations/bench_hooks.py --devices cpu --out /tmp/hooks.json

Two measurements, both on tensors so small (``--numel`` 256 fp32 values, 1 KiB) that the
copies and kernels cost next to nothing and what is left is the Python and autograd work
on the host:

1. **model** (through autograd, as in training): ``--layers`` (64) modules, each applying
   ``torch.sin`` ``--ops`` (16) times to its input; every ``sin`` saves its input, so a
   forward saves ``layers * ops`` tensors (counted with a counting
   ``saved_tensors_hooks`` pass, and checked against that product). A step is forward +
   ``y.sum().backward()`` on an input that requires grad; its time is the host wall
   clock (``perf_counter``) from the start of the forward to the end of the backward,
   after a device synchronisation at each end (CUDA), with Python's garbage collector off.
   Rows:

   * ``no hooks``: plain autograd;
   * ``identity hooks``: ``saved_tensors_hooks(lambda t: t, lambda t: t)``, the floor of
     any pair of Python hooks;
   * ``offload_layers=0``: ``ActivationOffloader(layers, offload_layers=0,
     min_tensor_bytes=0)``: module hooks installed; inside each layer call (none is
     offloaded) the offloader's saved-tensor hooks step aside and autograd saves the
     tensors itself;
   * ``offload all``: ``offload_layers=len(layers), min_tensor_bytes=0``: every saved
     tensor copied to the host, released, reloaded and rebuilt.

   Columns: ``step ms``: median of ``--repeats`` steps after ``--warmup``; ``saved``:
   tensors saved per step; ``us/saved vs none``: (step ms - step ms of ``no hooks``) *
   1000 / saved, the host cost the row adds per saved tensor (module hooks and group
   bookkeeping, paid per layer, are spread over the layer's tensors); ``us/saved vs
   identity``: the same against ``identity hooks``, i.e. the part that is the
   offloader's own; ``D2H / step``: ``stats.bytes_offloaded``.

2. **direct** (no autograd; ``pack_unpack_direct``, the one function that uses the
   scheduler's internals): ``--direct-tensors`` (4096) fresh tensors are passed to
   ``Step.pack`` in ``--direct-groups`` (16) groups, the forward is finished, then every
   handle is unpacked with ``unpack_hook`` (in reverse order, as a backward does) and
   finally dropped. Columns: ``pack``, ``unpack``, their sum ``pack+unpack`` (the
   figure the hot-path target is about), ``free`` (handle death: host blocks back to
   the pool), ``groups`` (``open_group``, ``close_group`` and ``finish_forward``: what
   is done per group, such as sealing a bucket of small tensors and issuing its copy,
   and releasing the device tensors, spread over the group's tensors) and ``total``
   (all four), each the median over ``--repeats`` runs of the phase's host time divided
   by the number of tensors, in us; for ``offloaded`` (every group offloaded: copied to
   the host, in one bucket per group for these small tensors, reloaded at the first
   unpack of a group) and ``kept`` (no group offloaded: classified and kept). Each group's
   tensors are dropped when it closes, as a layer's intermediates die when it returns.

Everything measured (every raw time, settings, environment) goes to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import offload
from benchmarks._common import environment, gc_off, median, synchronize, write_json


class SinLayer(nn.Module):
    """``ops`` times ``x = sin(x)``: saves ``ops`` tensors (each ``sin``'s input)."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = torch.sin(x)
        return x


# --------------------------------------------------------------------------------------
# 1. through autograd


def count_saved(layers: nn.ModuleList, x: torch.Tensor) -> int:
    """Tensors saved for backward by one forward (a counting saved-tensor hooks pass)."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(layers, x.clone().requires_grad_(True))
    y.sum().backward()
    return count


def run(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def time_steps(
    layers: nn.ModuleList,
    x: torch.Tensor,
    context: Callable[[], Any],
    repeats: int,
    warmup: int,
) -> list[float]:
    """Host milliseconds of forward + backward, ``repeats`` times after ``warmup``."""
    device = x.device
    times = []
    for i in range(warmup + repeats):
        xi = x.clone().requires_grad_(True)
        gc.collect()
        synchronize(device)
        with gc_off():
            start = time.perf_counter()
            with context():
                y = run(layers, xi)
            y.sum().backward()
            synchronize(device)
            elapsed = (time.perf_counter() - start) * 1e3
        del y, xi
        if i >= warmup:
            times.append(elapsed)
    return times


def bench_model(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    layers = nn.ModuleList(SinLayer(args.ops) for _ in range(args.layers))
    x = torch.randn(args.numel, device=device)
    saved = count_saved(layers, x)
    expected = args.layers * args.ops
    if saved != expected:
        raise RuntimeError(f"a forward saved {saved} tensors, expected {expected}")

    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    hooks_only = offload.ActivationOffloader(layers, offload_layers=0, min_tensor_bytes=0)
    offload_all = offload.ActivationOffloader(
        layers, offload_layers=len(layers), min_tensor_bytes=0
    )
    rows_in = [
        ("no hooks", contextlib.nullcontext, None),
        ("identity hooks", lambda: identity, None),
        ("offload_layers=0", lambda: hooks_only, hooks_only),
        ("offload all", lambda: offload_all, offload_all),
    ]
    rows = []
    for name, context, offloader in rows_in:
        times = time_steps(layers, x, context, args.repeats, args.warmup)
        row: dict[str, Any] = {"name": name, "step_ms": times, "step_ms_median": median(times)}
        if offloader is not None:
            stats = offloader.stats
            row["bytes_offloaded"] = stats.bytes_offloaded
            row["bytes_kept"] = dict(stats.bytes_kept)
            if stats.host_pool_bytes:
                raise RuntimeError(f"{name}: {stats.host_pool_bytes} host bytes still in use")
        rows.append(row)
    for offloader in (hooks_only, offload_all):
        offloader.close()
    base, ident = rows[0]["step_ms_median"], rows[1]["step_ms_median"]
    for row in rows:
        row["us_per_saved_vs_none"] = (row["step_ms_median"] - base) * 1e3 / saved
        row["us_per_saved_vs_identity"] = (row["step_ms_median"] - ident) * 1e3 / saved
    return {"saved_per_step": saved, "rows": rows}


# --------------------------------------------------------------------------------------
# 2. Step.pack / unpack_hook directly


def pack_unpack_direct(
    device: torch.device,
    offloaded: bool,
    tensors: int,
    groups: int,
    numel: int,
    repeats: int,
    warmup: int,
) -> dict[str, Any]:
    """Host time of ``Step.pack`` and ``unpack_hook`` per tensor, without autograd.

    The only code of the benchmarks that uses the scheduler's internals
    (``Runtime``, ``Step``, ``make_plan``, ``unpack_hook``): adapt
    it here when they change. Also runs against the flat layout and the package before
    its scheduler was split into modules (``offload/_scheduler.py``), for old-vs-new comparisons
    (``bench_versions.py``). One run: ``tensors`` fresh tensors packed in ``groups``
    groups (``open_group`` / ``pack`` ... / ``close_group``), ``finish_forward()``, every
    handle unpacked in reverse order, then every handle dropped. Returns the per-phase
    host seconds of every run and the medians in us per tensor.
    """
    from offload.config import OffloadConfig

    try:  # the package in subpackages (offload/_core/, offload/activations/)
        from offload._core._runtime import Runtime
        from offload.activations._handles import unpack_hook
        from offload.activations._schedule import make_plan
        from offload.activations._step import Step
    except ImportError:  # flat modules under offload/
        from offload._handles import unpack_hook  # type: ignore[no-redef]
        from offload._plan import make_plan  # type: ignore[no-redef]

        try:
            from offload._runtime import Runtime  # type: ignore[no-redef]
            from offload._step import Step  # type: ignore[no-redef]
        except ImportError:  # the package before its scheduler was split into modules
            from offload._scheduler import Runtime, Step  # type: ignore[no-redef]

    runtime = Runtime(OffloadConfig(min_tensor_bytes=0))
    per_group = tensors // groups
    chosen = list(range(groups)) if offloaded else []
    phases: dict[str, list[float]] = {"pack": [], "unpack": [], "free": [], "groups": []}
    for i in range(warmup + repeats):
        batch = [torch.randn(numel, device=device) for _ in range(per_group * groups)]
        step = Step(runtime, make_plan(groups, chosen, None))
        handles: list[Any] = []
        gc.collect()
        synchronize(device)
        with gc_off():
            pack_s = groups_s = 0.0
            for g in range(groups):
                start = time.perf_counter()
                step.open_group(None)
                mid = time.perf_counter()
                for t in batch[g * per_group : (g + 1) * per_group]:
                    handles.append(step.pack(t))
                end = time.perf_counter()
                step.close_group()
                pack_s += end - mid
                groups_s += (mid - start) + (time.perf_counter() - end)
                # the group's tensors die with it, as a layer's intermediates do when it
                # returns (their device memory is then the release's to give back)
                batch[g * per_group : (g + 1) * per_group] = [None] * per_group
            start = time.perf_counter()
            step.finish_forward()
            groups_s += time.perf_counter() - start
            del batch, t
            synchronize(device)
            start = time.perf_counter()
            for h in reversed(handles):
                unpack_hook(h)
            unpack_s = time.perf_counter() - start
            synchronize(device)
            start = time.perf_counter()
            handles.clear()
            free_s = time.perf_counter() - start
        if offloaded and step.read_stats().bytes_offloaded == 0:
            raise RuntimeError("nothing was offloaded")
        if i >= warmup:
            phases["pack"].append(pack_s)
            phases["unpack"].append(unpack_s)
            phases["free"].append(free_s)
            phases["groups"].append(groups_s)
    runtime.close()
    n = per_group * groups
    us = {k: median(v) * 1e6 / n for k, v in phases.items()}
    us["pack+unpack"] = us["pack"] + us["unpack"]
    us["total"] = us["pack+unpack"] + us["free"] + us["groups"]
    return {
        "path": "offloaded" if offloaded else "kept",
        "tensors": n,
        "seconds": phases,
        "us_per_tensor": us,
    }


# --------------------------------------------------------------------------------------
# report and main


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    s = result["settings"]
    console.print(
        f"[bold]bench_hooks[/bold]: torch {result['environment']['torch']}, "
        f"{s['layers']} layers x {s['ops']} sin = saved tensors of {s['numel']} fp32 values; "
        f"median of {s['repeats']} after {s['warmup']} warm-up; host wall clock"
    )
    for dev, res in result["devices"].items():
        model = res["model"]
        table = Table(title=f"{dev}: forward + backward ({model['saved_per_step']} saved / step)")
        for col in ("method", "step ms", "us/saved vs none", "us/saved vs identity", "D2H / step"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for row in model["rows"]:
            table.add_row(
                row["name"],
                f"{row['step_ms_median']:.2f}",
                f"{row['us_per_saved_vs_none']:.1f}",
                f"{row['us_per_saved_vs_identity']:.1f}",
                str(row.get("bytes_offloaded", "-")),
            )
        console.print(table)
        table = Table(title=f"{dev}: Step.pack + unpack_hook directly, us per tensor")
        cols = ("pack", "unpack", "pack+unpack", "free", "groups", "total")
        for col in ("path", "tensors", *cols):
            table.add_column(col, justify="left" if col == "path" else "right")
        for row in res["direct"]:
            us = row["us_per_tensor"]
            table.add_row(row["path"], str(row["tensors"]), *(f"{us[k]:.1f}" for k in cols))
        console.print(table)
    console.print("Columns: header of benchmarks/activations/bench_hooks.py.")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices (default: cpu, and cuda when available)",
    )
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--ops", type=int, default=16, help="sin calls (saved tensors) per layer")
    parser.add_argument("--numel", type=int, default=256, help="elements per saved tensor")
    parser.add_argument("--repeats", type=int, default=31, help="timed runs per row (>= 3)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--direct-tensors", type=int, default=4096)
    parser.add_argument("--direct-groups", type=int, default=16)
    parser.add_argument(
        "--cpu-threads", type=int, default=1, help="torch threads on the CPU (tiny ops)"
    )
    args = parser.parse_args(argv)
    if args.devices is None:
        args.devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        args.devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    for d in args.devices:
        if torch.device(d).type == "cuda" and not torch.cuda.is_available():
            parser.error("CUDA is not available here; use --devices cpu")
    if args.repeats < 3 or args.layers < 1 or args.ops < 1 or args.numel < 1:
        parser.error("--repeats >= 3, --layers, --ops and --numel >= 1")
    if args.direct_groups < 1 or args.direct_tensors < args.direct_groups:
        parser.error("--direct-groups >= 1 and --direct-tensors >= --direct-groups")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "benchmark": "bench_hooks",
        "command": [sys.executable, *sys.argv],
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": environment(torch.device(args.devices[-1])),
        "offload_file": offload.__file__,  # the package measured (bench_versions.py)
        "devices": {},
    }
    for name in args.devices:
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        result["devices"][str(device)] = {
            "model": bench_model(args, device),
            "direct": [
                pack_unpack_direct(
                    device,
                    offloaded,
                    args.direct_tensors,
                    args.direct_groups,
                    args.numel,
                    args.repeats,
                    args.warmup,
                )
                for offloaded in (True, False)
            ],
        }
    print_report(result)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
