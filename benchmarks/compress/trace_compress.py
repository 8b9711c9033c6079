"""Where the time of a compressed offload step goes: one profiled ref-8L step per row.

Command (one GPU, about 30 s)::

    PYTHONPATH=. python3 benchmarks/compress/trace_compress.py --ks 4,7 \
        --out benchmarks/results/codec_share.json

Rows: no offload; ``offload k`` exact; ``offload k`` with ``compress="fp8"``, for each k
of ``--ks``. Each row runs 3 warm-up steps, then one step under ``torch.profiler``
(CPU + CUDA activities). Printed per row: the step's device time (first kernel start to
last kernel end), and per CUDA stream the busy time of its kernels and of its copies
(union of intervals, ms) and the number of events; the codec kernels' count and total
time (names containing ``quantize``); and the compute stream's kernel time, whose growth
over no offload is the compute the other streams slowed down.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import torch

import offload
from benchmarks._common import union_length
from offload.models import ReferenceModel


def profile_row(model: ReferenceModel, x: torch.Tensor, offloader: Any) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        if offloader is None:
            model.loss(x).backward()
        else:
            with offloader:
                loss = model.loss(x)
            loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    streams: dict[str, dict[str, list]] = defaultdict(lambda: {"kernel": [], "copy": []})
    codec: list[float] = []
    first, last = float("inf"), float("-inf")
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        a, b = e.time_range.start, e.time_range.end
        first, last = min(first, a), max(last, b)
        kind = "copy" if e.name.startswith("Memcpy") or e.name.startswith("Memset") else "kernel"
        key = str(e.device_resource_id)  # the CUDA stream of a kernel or copy
        streams[key][kind].append((a, b))
        if "quantize" in e.name:
            codec.append(b - a)
    out = {
        "device_ms": (last - first) / 1e3,
        "codec_kernels": len(codec),
        "codec_ms": sum(codec) / 1e3,
        "streams": {
            k: {
                "kernel_ms": union_length(v["kernel"]) / 1e3,
                "kernels": len(v["kernel"]),
                "copy_ms": union_length(v["copy"]) / 1e3,
                "copies": len(v["copy"]),
            }
            for k, v in streams.items()
        },
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,4")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ReferenceModel(8, 4096, 32, 14336, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    rows = {"none": profile_row(model, x, None)}
    for k in [int(v) for v in args.ks.split(",")]:
        for compress in (None, "fp8"):
            off = offload.ActivationOffloader(model.layers, offload_layers=k, compress=compress)
            rows[f"k={k} {compress or 'exact'}"] = profile_row(model, x, off)
            off.close()
    for name, row in rows.items():
        print(
            f"{name}: device {row['device_ms']:.1f} ms, codec {row['codec_kernels']} kernels "
            f"{row['codec_ms']:.2f} ms"
        )
        for sid, st in sorted(row["streams"].items(), key=lambda kv: -kv[1]["kernel_ms"]):
            print(
                f"   stream {sid}: kernels {st['kernels']} busy {st['kernel_ms']:.2f} ms; "
                f"copies {st['copies']} busy {st['copy_ms']:.2f} ms"
            )
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
