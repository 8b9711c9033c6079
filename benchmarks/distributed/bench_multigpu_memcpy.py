"""Pinned host <-> GPU copy bandwidth when several GPUs of one host copy at once.

Command (a machine with one or more CUDA GPUs; about a minute)::

    PYTHONPATH=. python3 benchmarks/distributed/bench_multigpu_memcpy.py --out benchmarks/results/multigpu_memcpy.json

For N = 1 .. number of GPUs, N processes (one per GPU, ``torch.multiprocessing``) each
copy ``--mib`` (1024) MiB device -> pinned host and pinned host -> device, ``--repeats``
(5) times after one warm-up, starting together (a barrier before each copy); each
process allocates its pinned buffer from its own thread after ``torch.cuda.set_device``,
so the host memory follows the OS's first-touch placement. Columns: per-rank GB/s each
way (median of the repeats, CUDA events), their sum, and each GPU's NUMA node as the
platform reports it (``/sys/bus/pci/devices/<bus id>/numa_node``; -1 or n/a when it does
not say). This is the link share every rank gets before a model runs (the first part of
the several-GPU benchmark; the FSDP2 step benchmark is ``bench_multigpu.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.multiprocessing as mp


def numa_node(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    try:
        bus_id = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return None
    try:
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def worker(rank: int, n: int, nbytes: int, repeats: int, barrier, out) -> None:
    torch.cuda.set_device(rank)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
    result = {"d2h": [], "h2d": []}
    for i in range(repeats + 1):
        for kind, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
            barrier.wait()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:
                result[kind].append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    out.put((rank, {k: statistics.median(v) for k, v in result.items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("needs at least one CUDA GPU")
    ctx = mp.get_context("spawn")
    rows = []
    for n in range(1, gpus + 1):
        barrier, out = ctx.Barrier(n), ctx.Queue()
        procs = [
            ctx.Process(target=worker, args=(r, n, args.mib << 20, args.repeats, barrier, out))
            for r in range(n)
        ]
        for proc in procs:
            proc.start()
        got = dict(out.get() for _ in procs)
        for proc in procs:
            proc.join()
        rows.append({"copiers": n, "per_rank": [got[r] for r in range(n)]})
        d2h = [got[r]["d2h"] for r in range(n)]
        h2d = [got[r]["h2d"] for r in range(n)]
        print(
            f"{n} concurrent copiers: D2H GB/s per rank {[round(v, 1) for v in d2h]} "
            f"(sum {sum(d2h):.1f}); H2D {[round(v, 1) for v in h2d]} (sum {sum(h2d):.1f})"
        )
    nodes = [numa_node(i) for i in range(gpus)]
    print(f"GPU NUMA nodes: {nodes}")
    result = {
        "gpus": gpus,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "numa_nodes": nodes,
        "rows": rows,
        "mib": args.mib,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
