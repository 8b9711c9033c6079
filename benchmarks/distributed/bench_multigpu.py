"""FSDP2 with activation offloading when every rank of one host copies at once.

Command (one host, one process per GPU; an estimated one to two minutes on 2 H200s)::

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/distributed/bench_multigpu.py \\
        --out /tmp/multigpu.json

CPU smoke run (gloo, the ``tiny`` preset, 2 processes; under a minute)::

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/distributed/bench_multigpu.py --device cpu \\
        --preset tiny --out /tmp/mg.json

The first part of the several-GPU study, the pinned memcpy rate each rank gets when N
processes copy at once with no model running, is ``benchmarks/distributed/bench_multigpu_memcpy.py``
(``python3 benchmarks/distributed/bench_multigpu_memcpy.py --out benchmarks/results/multigpu_memcpy.json``); this script
does not repeat it. ``gpu_suite.sh multigpu`` runs both.

Model (``--preset ref8l``, the default): ``offload.models.ReferenceModel``, "ref-8L"
of docs/performance.md: 8 Llama-style layers, hidden 4096, 32 heads, ffn 14336, seq
4096, batch 1 per rank, bf16 weights; loss = mean of squares of the output, in fp32.
``--preset tiny`` (for the CPU smoke run): 8 layers, hidden 256, 4 heads, ffn 704, seq
128, batch 2, fp32 (bf16 matmuls are about 20x slower than fp32 on a CPU without bf16
units), ``min_tensor_bytes=0`` (its tensors are below the library's default). Every
rank builds the model from seed 0, then ``torch.distributed.fsdp.fully_shard`` wraps
each layer and then the root on a 1-D mesh of all ranks (as ``examples/fsdp2.py``). Each
rank draws its own inputs (a fresh random ``x`` per step, seeded by rank and step, that
does not require grad). NCCL on GPUs (one GPU per rank: ``LOCAL_RANK``), gloo on the CPU.
``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set (unless given)
before the process group exists: NVLink multicast stays off. ``CUBLAS_WORKSPACE_CONFIG``
defaults to ``:4096:8`` (32 MiB, the size PyTorch picks on sm90 without it), which
deterministic mode requires; the values used are in the JSON (``env_vars``).

Rows: for every k of ``--ks`` (default ``0,2,4,7``; 0 always runs, it is the reference
of ``x k=0``) and every rank: k = 0 is plain FSDP2 (no offloader at all); k > 0 is
``offload.ActivationOffloader(layers, offload_layers=k)`` on every rank (the first k
layers offloaded, other settings the library's), the context around forward and loss.
A step is forward + backward (no optimizer step): ``--warmup`` (3) steps, then
``--steps`` (7) timed steps, each after a device synchronisation and a barrier of all
ranks (so every rank starts together and copies at the same time as the others), then
one memory step and, for k > 0, the copy-timing steps below.

Columns (one row per k and rank):

* ``step ms``: median over the timed steps of this rank's device time of one step,
  CUDA events on the compute stream around forward + backward (FSDP2's backward ends
  with the compute stream waiting for its reduce-scatters, so they are inside);
  ``perf_counter`` on the CPU. Gradients are set to ``None`` before each timed step,
  outside the span. Raw times and host wall times are in the JSON.
* ``x k=0``: step ms / step ms of k = 0 on the same rank in this run.
* ``act GiB``: ``torch.cuda.max_memory_allocated()`` during the memory step minus
  ``torch.cuda.memory_allocated()`` just before it. The memory step keeps the previous
  step's gradients, so "before" holds this rank's weight and gradient shards and the
  input; the difference is what the step adds: saved activations, reload buffers,
  backward workspace, and FSDP2's all-gathered layers and reduce-scatter buffers (the
  same in every row). ``peak GiB``: ``max_memory_allocated()`` over the timed steps.
* ``D2H / step``, ``H2D / step``: ``stats.bytes_offloaded`` and ``stats.bytes_reloaded``
  of the offloader after the last timed step (binary units).
* ``D2H GB/s``, ``H2D GB/s``: copy rate achieved while every rank copies: a second
  offloader with the same k and ``timing=True`` (CUDA events around every batch of
  copies on the offloader's copy streams; host clock on the CPU's synchronous path) runs
  one warm-up and ``--copy-steps`` (3) steps after the timed ones; per step, bytes each
  way / the summed ``d2h_seconds`` (``h2d_seconds``) of its ``LayerStats``; the median
  of the steps (10^9 B/s). The timed steps run without ``timing`` (library default).
* ``stall ms``: the summed ``stall_seconds`` of those timing steps (time the compute
  stream stood waiting for a copy), median of the steps; 0 on the CPU.
* ``pool peak``: ``stats.host_pool_peak_bytes``, the most host bytes the offloader's
  pool handed out at once (its ``host_pool_reserved_bytes``, the pinned slabs it holds,
  is in the JSON).
* ``bitwise``: the correctness check below for this k and rank (``-``: not checked).

Correctness (after the rows, ``--check-ks``, default ``2,7``): with
``torch.use_deterministic_algorithms(True)`` and one fixed input per rank, FSDP2 without
offloading runs one step (loss and every parameter gradient's local shard,
``p.grad.to_local()``, kept) and again (``baseline_repeatable``: is the platform
deterministic at all); then, per k, a fresh ``ActivationOffloader(offload_layers=k)``
runs ``CHECK_STEPS`` (2) steps on the same input and weights. ``bitwise_equal``: the loss
and every gradient shard ``torch.equal`` to the first baseline on every one of those
steps, and the offloader sent bytes (``bytes_offloaded > 0``) on each. The script exits
with status 1 if any rank's check fails.

Host facts per rank (printed below the tables, in the JSON under ``host``): the GPU's
NUMA node as the platform reports it (``/sys/bus/pci/devices/<bus id>/numa_node``, -1 when
it does not say; ``numa_node`` of bench_multigpu_memcpy.py), the host's NUMA node count
(``/sys/devices/system/node/node*``), the CPUs this process may run on; host memory is
placed by the OS (first touch), the library binds nothing. Budget: per rank
``offload._host_pool.default_host_limit()`` (half the available memory / LOCAL_WORLD_SIZE)
and ``psutil`` available memory before any pool exists; for the largest k, each rank's
pool peak, and ``budget_ok``: the sum of the ranks' pool peaks is below the smallest
available memory any rank saw before the rows (``within_limit``: each peak <= its rank's
default limit).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import glob
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# Before torch creates a CUDA context or a process group: NVLink multicast off (the
# device hosts require it), and the cuBLAS workspace deterministic mode needs.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import offload  # noqa: E402
from benchmarks._common import GIB, Timer, environment, median, synchronize, write_json  # noqa: E402
from benchmarks.distributed.bench_multigpu_memcpy import numa_node  # noqa: E402
from offload._host_pool import default_host_limit  # noqa: E402
from offload.models import ReferenceModel  # noqa: E402
from offload.profiling import format_bytes  # noqa: E402

CHECK_STEPS = 2  # offloaded steps compared with the baseline, per checked k
ENV_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "CUBLAS_WORKSPACE_CONFIG")


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model sizes, per-rank batch, the offloader's ``min_tensor_bytes``, the dtype."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    batch: int
    min_tensor_bytes: int | None  # None: the library's default
    dtype: torch.dtype


PRESETS = {
    "ref8l": Preset(8, 4096, 32, 14336, 4096, 1, None, torch.bfloat16),
    "tiny": Preset(8, 256, 4, 704, 128, 2, 0, torch.float32),
}


# --------------------------------------------------------------------------------------
# setup


def init_distributed(kind: str) -> torch.device:
    """Join torchrun's process group (NCCL on this rank's GPU, gloo on the CPU)."""
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node N " + sys.argv[0])
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // local)))
        dist.init_process_group("gloo")
    return device


def host_facts(device: torch.device) -> dict[str, Any]:
    """This rank's NUMA placement and host budget, before any host pool exists."""
    nodes = glob.glob("/sys/devices/system/node/node[0-9]*")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count()
    return {
        "gpu_numa_node": numa_node(device.index) if device.type == "cuda" else None,
        "host_numa_nodes": len(nodes),
        "cpu_affinity": cpus,
        "host_memory_placement": "OS first touch (the library binds no NUMA node)",
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "default_host_limit": default_host_limit(),
        "available_bytes": psutil.virtual_memory().available,
    }


def build(preset: Preset, device: torch.device) -> ReferenceModel:
    """ReferenceModel from seed 0 on every rank; each layer, then the root, sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ReferenceModel(
        preset.layers, preset.hidden, preset.heads, preset.ffn, device=device, dtype=preset.dtype
    )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@dataclasses.dataclass
class Bench:
    """The sharded model and what a step needs."""

    model: ReferenceModel
    preset: Preset
    device: torch.device
    rank: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def new_input(self, seed: int) -> torch.Tensor:
        """This rank's input for ``seed`` (the same tensor every time it is asked for)."""
        p = self.preset
        gen = torch.Generator(self.device).manual_seed(1_000_003 * self.rank + seed)
        return torch.randn(
            p.batch, p.seq, p.hidden, device=self.device, dtype=p.dtype, generator=gen
        )

    def offloader(self, k: int, *, timing: bool = False) -> offload.ActivationOffloader:
        kwargs: dict[str, Any] = {"offload_layers": k, "timing": timing}
        if self.preset.min_tensor_bytes is not None:
            kwargs["min_tensor_bytes"] = self.preset.min_tensor_bytes
        return offload.ActivationOffloader(self.model.layers, **kwargs)

    def step(self, x: torch.Tensor, off: offload.ActivationOffloader | None) -> torch.Tensor:
        """Forward (under ``off``) and backward; returns the detached loss."""
        with off if off is not None else contextlib.nullcontext():
            loss = self.model.loss(x)
        loss.backward()
        return loss.detach()

    def align(self) -> None:
        """Every rank idle and at the same point: synchronize, barrier."""
        synchronize(self.device)
        dist.barrier()

    def free(self) -> None:
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# rows


def copy_rates(bench: Bench, k: int, steps: int) -> dict[str, Any]:
    """Copy times of an offloader with ``timing=True``: one warm-up, then ``steps``."""
    off = bench.offloader(k, timing=True)
    per_step = []
    try:
        for i in range(steps + 1):
            bench.model.zero_grad(set_to_none=True)
            x = bench.new_input(20_000 + i)
            bench.align()
            bench.step(x, off)
            synchronize(bench.device)
            if i == 0:
                continue
            stats = off.stats  # resolves the recorded events (the device is idle)
            seconds = {
                d: sum(getattr(la, f"{d}_seconds") or 0.0 for la in stats.layers)
                for d in ("d2h", "h2d", "stall")
            }
            per_step.append(
                {
                    "bytes_d2h": stats.bytes_offloaded,
                    "bytes_h2d": stats.bytes_reloaded,
                    "d2h_ms": seconds["d2h"] * 1e3,
                    "h2d_ms": seconds["h2d"] * 1e3,
                    "stall_ms": seconds["stall"] * 1e3,
                }
            )
    finally:
        off.close()

    def rate(d: str) -> float | None:
        rates = [s[f"bytes_{d}"] / (s[f"{d}_ms"] * 1e6) for s in per_step if s[f"{d}_ms"] > 0]
        return median(rates) if rates else None

    return {
        "steps": per_step,
        "d2h_gbps": rate("d2h"),
        "h2d_gbps": rate("h2d"),
        "stall_ms": median([s["stall_ms"] for s in per_step]),
    }


def measure(bench: Bench, k: int, args: argparse.Namespace) -> dict[str, Any]:
    """One row of this rank: warm-up, timed steps, memory step, copy rates (k > 0)."""
    off = bench.offloader(k) if k else None
    timer = Timer(bench.device)
    seed = 1000 * (k + 1)
    row: dict[str, Any] = {"k": k, "rank": bench.rank}
    try:
        for i in range(args.warmup):
            bench.model.zero_grad(set_to_none=True)
            bench.step(bench.new_input(seed + i), off)
        seed += args.warmup
        bench.align()
        if bench.cuda:
            torch.cuda.reset_peak_memory_stats(bench.device)
        step_ms, wall_ms = [], []
        for i in range(args.steps):
            bench.model.zero_grad(set_to_none=True)
            x = bench.new_input(seed + i)
            bench.align()
            wall = time.perf_counter()
            start = timer.mark()
            bench.step(x, off)
            end = timer.mark()
            synchronize(bench.device)
            wall_ms.append((time.perf_counter() - wall) * 1e3)
            step_ms.append(timer.elapsed_ms(start, end))
            del x
        seed += args.steps
        row.update(step_ms=step_ms, wall_ms=wall_ms, step_ms_median=median(step_ms))
        if off is not None:
            stats = off.stats
            row.update(
                bytes_d2h=stats.bytes_offloaded,
                bytes_h2d=stats.bytes_reloaded,
                bytes_released=stats.bytes_released,
                host_pool_peak_bytes=stats.host_pool_peak_bytes,
                host_pool_reserved_bytes=stats.host_pool_reserved_bytes,
                available_bytes_with_pool=psutil.virtual_memory().available,
                stats=stats.to_dict(),
            )
        else:
            row.update(bytes_d2h=0, bytes_h2d=0, host_pool_peak_bytes=0)
        if bench.cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(bench.device) / GIB
            # memory step: the last timed step's gradients stay allocated
            x = bench.new_input(seed)
            bench.align()
            before = torch.cuda.memory_allocated(bench.device)
            torch.cuda.reset_peak_memory_stats(bench.device)
            bench.step(x, off)
            synchronize(bench.device)
            peak = torch.cuda.max_memory_allocated(bench.device)
            row["memory_step"] = {"before_gib": before / GIB, "peak_gib": peak / GIB}
            row["activation_gib"] = (peak - before) / GIB
            del x
    finally:
        if off is not None:
            off.close()
        bench.free()
    if k:
        row["copy_timing"] = copy_rates(bench, k, args.copy_steps)
        bench.free()
    return row


# --------------------------------------------------------------------------------------
# correctness


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else _local(p.grad).detach().clone() for p in model.parameters()]


def _compare(
    loss: torch.Tensor,
    grads: list[torch.Tensor | None],
    ref_loss: torch.Tensor,
    ref_grads: list[torch.Tensor | None],
    names: list[str],
) -> dict[str, Any]:
    differ = [
        name
        for name, g, r in zip(names, grads, ref_grads)
        if (g is None) != (r is None) or (g is not None and not torch.equal(g, r))
    ]
    return {"loss_equal": torch.equal(loss, ref_loss), "grads_differ": differ}


def check(bench: Bench, ks: Sequence[int]) -> dict[str, Any]:
    """Loss and gradient shards with offloading vs without, deterministic algorithms on."""
    model = bench.model
    names = [n for n, _ in model.named_parameters()]
    x = bench.new_input(99_999)

    def run(off: offload.ActivationOffloader | None) -> tuple[torch.Tensor, list[Any]]:
        model.zero_grad(set_to_none=True)
        bench.align()
        loss = bench.step(x, off)
        synchronize(bench.device)
        return loss, _grads(model)

    result: dict[str, Any] = {"rank": bench.rank, "ks": {}}
    ref_grads: list[Any] = []
    torch.use_deterministic_algorithms(True)
    try:
        ref_loss, ref_grads = run(None)
        again = _compare(*run(None), ref_loss, ref_grads, names)
        result["baseline_repeatable"] = again["loss_equal"] and not again["grads_differ"]
        result["baseline_differ"] = again["grads_differ"]
        result["loss"] = ref_loss.item()
        for k in ks:
            off = bench.offloader(k)
            steps = []
            try:
                for _ in range(CHECK_STEPS):
                    loss, grads = run(off)
                    stats = off.stats
                    steps.append(
                        _compare(loss, grads, ref_loss, ref_grads, names)
                        | {
                            "loss": loss.item(),
                            "bytes_offloaded": stats.bytes_offloaded,
                            "bytes_reloaded": stats.bytes_reloaded,
                        }
                    )
                    del grads
            finally:
                off.close()
            result["ks"][k] = {
                "bitwise_equal": all(s["loss_equal"] and not s["grads_differ"] for s in steps),
                "offloaded_bytes_positive": all(s["bytes_offloaded"] > 0 for s in steps),
                "steps": steps,
            }
    finally:
        torch.use_deterministic_algorithms(False)
        del ref_grads
        bench.free()
    return result


# --------------------------------------------------------------------------------------
# report


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_report(result: dict[str, Any]) -> None:
    """Rank 0: header, the table, the host facts and the verdicts, with rich."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    env, p, s = result["environments"][0], result["settings"]["model"], result["settings"]
    where = f"{env.get('gpu', env['device'])}"
    console.print(
        f"[bold]bench_multigpu[/bold]: FSDP2, {result['world_size']} ranks "
        f"({result['backend']}) on {where}, {s['preset']} (hidden {p['hidden']}, heads "
        f"{p['heads']}, ffn {p['ffn']}, {p['layers']} layers, seq {p['seq']}, batch "
        f"{p['batch']} per rank, {p['dtype'].removeprefix('torch.')}), torch {env['torch']} (CUDA "
        f"{env['torch_cuda'] or 'n/a'}), offload {env['offload']}; "
        + ", ".join(f"{k}={v}" for k, v in result["env_vars"].items())
    )
    checks = {(c["rank"], k): v for c in result["check"] for k, v in c.get("ks", {}).items()}
    table = Table(title="forward + backward step per rank (no optimizer)")
    for col in (
        "k",
        "rank",
        "step ms",
        "x k=0",
        "act GiB",
        "peak GiB",
        "D2H / step",
        "H2D / step",
        "D2H GB/s",
        "H2D GB/s",
        "stall ms",
        "pool peak",
        "bitwise",
    ):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        timing = row.get("copy_timing") or {}
        c = checks.get((row["rank"], row["k"]))
        table.add_row(
            "0 (FSDP2 only)" if row["k"] == 0 else str(row["k"]),
            str(row["rank"]),
            f"{row['step_ms_median']:.1f}",
            f"{row['ratio_to_k0']:.3f}",
            _fmt(row.get("activation_gib"), ".2f"),
            _fmt(row.get("peak_allocated_gib"), ".2f"),
            format_bytes(row["bytes_d2h"]),
            format_bytes(row["bytes_h2d"]),
            _fmt(timing.get("d2h_gbps"), ".1f") if row["k"] else "-",
            _fmt(timing.get("h2d_gbps"), ".1f") if row["k"] else "-",
            _fmt(timing.get("stall_ms"), ".1f") if row["k"] else "-",
            format_bytes(row["host_pool_peak_bytes"]) if row["k"] else "-",
            "-" if c is None else ("yes" if c["bitwise_equal"] else "[red]NO[/red]"),
        )
    console.print(table)
    clock = "CUDA events" if result["backend"] == "nccl" else "perf_counter"
    console.print(
        f"step ms: median of {s['steps']} timed steps after {s['warmup']} warm-up "
        f"({clock}), every rank starting together; act GiB: peak allocated in a step minus "
        "allocated before it (includes FSDP2's all-gathered layers); GB/s: bytes / summed "
        f"copy time of an offloader with timing=True (median of {s['copy_steps']} steps, "
        "all ranks copying at once); stall ms: compute stream waiting for copies; pool "
        "peak: most host bytes handed out at once. Definitions: header of "
        "benchmarks/distributed/bench_multigpu.py; the pinned memcpy rate with N concurrent copiers: "
        "benchmarks/distributed/bench_multigpu_memcpy.py."
    )
    for h in result["host"]:
        console.print(
            f"rank {h['rank']}: GPU NUMA node {h['gpu_numa_node']} of "
            f"{h['host_numa_nodes']} host node(s), {h['cpu_affinity']} CPUs; "
            f"default_host_limit {format_bytes(h['default_host_limit'])} (LOCAL_WORLD_SIZE "
            f"{h['local_world_size']}), available {format_bytes(h['available_bytes'])}"
        )
    b = result["budget"]
    if b:
        console.print(
            f"host budget at k={b['k']}: pool peaks "
            + " + ".join(format_bytes(v) for v in b["pool_peak_bytes"])
            + f" = {format_bytes(b['pool_peak_sum'])} (reserved "
            f"{format_bytes(b['pool_reserved_sum'])}) vs available "
            f"{format_bytes(b['available_min'])}: budget_ok {b['budget_ok']}, each peak "
            f"within its default limit: {b['within_limit']}"
        )
    for c in result["check"]:
        ks = ", ".join(
            f"k={k}: bitwise_equal {v['bitwise_equal']}, bytes offloaded "
            f"{[format_bytes(st['bytes_offloaded']) for st in v['steps']]}"
            for k, v in c.get("ks", {}).items()
        )
        error = f", error: {c['error']}" if c.get("error") else ""
        console.print(
            f"check rank {c['rank']} (deterministic algorithms, {CHECK_STEPS} steps each): "
            f"baseline repeatable {c.get('baseline_repeatable')}; {ks}{error}"
        )
    console.print(f"[bold]{'PASS' if result['ok'] else 'FAIL'}[/bold]: {result['verdict']}")


# --------------------------------------------------------------------------------------
# main


def _int_list(text: str, what: str, ok: Callable[[int], bool], parser: Any) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{what} must be comma-separated integers; got {text!r}")
    bad = [v for v in values if not ok(v)]
    if bad:
        parser.error(f"{what}: {bad} out of range")
    return sorted(set(values))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="ref8l")
    parser.add_argument("--ks", default="0,2,4,7", help="offload_layers values (0 always runs)")
    parser.add_argument(
        "--check-ks", default="2,7", help="k values of the bitwise check (empty: none)"
    )
    parser.add_argument("--steps", type=int, default=7, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per row")
    parser.add_argument(
        "--copy-steps", type=int, default=3, help="steps of the timing=True offloader per k"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", required=True, help="path of the JSON result (rank 0)")
    args = parser.parse_args(argv)
    layers = PRESETS[args.preset].layers
    args.ks = sorted({0, *_int_list(args.ks, "--ks", lambda k: 0 <= k <= layers, parser)})
    args.check_ks = _int_list(args.check_ks, "--check-ks", lambda k: 1 <= k <= layers, parser)
    for name, least in (("steps", 1), ("warmup", 1), ("copy_steps", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu --preset tiny")
    return args


def summarize(result: dict[str, Any], check_ks: Sequence[int]) -> None:
    """Fill ``budget``, ``ok`` and ``verdict`` from every rank's numbers."""
    rows, hosts = result["rows"], result["host"]
    offloaded = [r for r in rows if r["k"]]
    if offloaded:
        kmax = max(r["k"] for r in offloaded)
        at = sorted((r for r in offloaded if r["k"] == kmax), key=lambda r: r["rank"])
        peaks = [r["host_pool_peak_bytes"] for r in at]
        available = min(h["available_bytes"] for h in hosts)
        result["budget"] = {
            "k": kmax,
            "pool_peak_bytes": peaks,
            "pool_reserved_bytes": [r["host_pool_reserved_bytes"] for r in at],
            "pool_peak_sum": sum(peaks),
            "pool_reserved_sum": sum(r["host_pool_reserved_bytes"] for r in at),
            "available_min": available,
            "budget_ok": sum(peaks) < available,
            "within_limit": all(
                r["host_pool_peak_bytes"] <= hosts[r["rank"]]["default_host_limit"] for r in at
            ),
        }
    else:
        result["budget"] = None
    problems = []
    for c in result["check"]:
        if c.get("error"):
            problems.append(f"rank {c['rank']}: {c['error']}")
        for k in check_ks:
            v = c.get("ks", {}).get(k)
            if v is None:
                problems.append(f"rank {c['rank']} k={k}: not checked")
            elif not v["bitwise_equal"]:
                problems.append(f"rank {c['rank']} k={k}: not bitwise equal")
            elif not v["offloaded_bytes_positive"]:
                problems.append(f"rank {c['rank']} k={k}: no bytes offloaded")
    for r in offloaded:
        if not r["bytes_d2h"]:
            problems.append(f"rank {r['rank']} k={r['k']}: no bytes offloaded in the timed steps")
    result["ok"] = not problems
    result["verdict"] = (
        "; ".join(problems)
        if problems
        else f"loss and gradient shards bitwise equal for k in {list(check_ks)} on every "
        "rank, bytes offloaded for every k > 0"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    preset = PRESETS[args.preset]
    try:
        host = {"rank": rank} | host_facts(device)
        bench = Bench(build(preset, device), preset, device, rank)
        rows = [measure(bench, k, args) for k in args.ks]
        for row in rows:
            row["ratio_to_k0"] = row["step_ms_median"] / rows[0]["step_ms_median"]
        try:
            checked = check(bench, args.check_ks)
        except Exception as exc:  # record it; the other ranks meet the same op
            checked = {"rank": rank, "ks": {}, "error": f"{type(exc).__name__}: {exc}"}
        mine = {"host": host, "rows": rows, "check": checked, "env": environment(device)}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        result: dict[str, Any] = {
            "benchmark": "bench_multigpu",
            "command": [sys.executable, *sys.argv],
            "world_size": world,
            "backend": dist.get_backend(),
            "env_vars": {name: os.environ.get(name) for name in ENV_VARS},
            "settings": {
                "preset": args.preset,
                "model": {
                    f.name: str(v) if isinstance(v, torch.dtype) else v
                    for f in dataclasses.fields(preset)
                    for v in [getattr(preset, f.name)]
                },
                "ks": args.ks,
                "check_ks": args.check_ks,
                "check_steps": CHECK_STEPS,
                "steps": args.steps,
                "warmup": args.warmup,
                "copy_steps": args.copy_steps,
                "cpu_threads": torch.get_num_threads(),
            },
            "memcpy_benchmark": "benchmarks/distributed/bench_multigpu_memcpy.py",
            "environments": [g["env"] for g in gathered],
            "host": [g["host"] for g in gathered],
            "rows": sorted(
                (r for g in gathered for r in g["rows"]), key=lambda r: (r["k"], r["rank"])
            ),
            "check": [g["check"] for g in gathered],
        }
        summarize(result, args.check_ks)
        if rank == 0:
            print_report(result)
            write_json(args.out, result)
            print(f"wrote {args.out}")
        dist.barrier()  # every rank leaves together (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
