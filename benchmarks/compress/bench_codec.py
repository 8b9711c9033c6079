"""Throughput of the blockwise FP8 codec of compressed offload (``offload/_core/_compress.py``).

Command (one CUDA GPU, a few seconds; without a GPU, a small eager run on the CPU)::

    PYTHONPATH=. python3 benchmarks/compress/bench_codec.py --out benchmarks/results/codec.json
    PYTHONPATH=. python3 benchmarks/compress/bench_codec.py --device cpu --out /tmp/codec.json
    # also try other tilings of the Triton kernels (blocks per program x warps)
    PYTHONPATH=. python3 benchmarks/compress/bench_codec.py --sweep --out /tmp/codec_sweep.json

Input: ``--mib`` MiB (default 704 on CUDA, 16 on the CPU) of N(0, 1) values per dtype of
``--dtypes`` (default bf16), as one flat tensor, and a *ragged* copy of it with 200 more
elements. The aligned size has a multiple of 4 blocks, so the fp8 codes (which start
after the ``4 * ceil(n / 128)`` scale bytes) are 16-byte aligned and the kernels use
vector stores/loads for them; the ragged one has not, which shows the cost of the
byte-wise accesses Triton then emits for the codes.

Rows: ``op`` (``quantize``: ``quantize_into``, tensor -> packed bytes; ``dequantize``:
``dequantize_into``, packed bytes -> tensor) x ``impl`` (``triton``: the fused kernels,
what CUDA tensors use on GPUs with hardware fp8 conversion, compute capability 8.9 or
newer; ``eager``: the torch reference, which allocates float32 temporaries; on the CPU
and older GPUs only ``eager``).

Columns: ``ms``: median over ``--repeats`` calls after ``--warmup``, each timed alone
(CUDA events on the current stream; ``perf_counter`` on the CPU); ``GB/s moved``: (bytes
read + bytes written) / ms, i.e. original + packed bytes, 10^9 B/s: compare with the
device's memory bandwidth; ``GB/s of input``: original tensor bytes / ms, i.e. how fast
the codec turns activations into (or back from) the packed form: compare with the host
link; ``packed/orig``: packed bytes / original bytes. A line then checks that the Triton
and eager packed bytes (and decodes) are identical at that size.

The *floor* line per dtype times torch's own copy of the aligned tensor (one read and one
write) and its unscaled cast to e4m3fn, and gives what a quantize or dequantize costs at
best: the original plus packed bytes it must move, at the copy's rate. The codec kernels
are compared with it, not with the device's nominal bandwidth.

On CUDA the pinned device -> host bandwidth (``_common.pinned_bandwidth``, 256 MiB) is
measured too, and the table's last lines compare, per dtype, the copy of the original
tensor with quantize + copy of the packed bytes (device -> host), and the copy back of
the packed bytes + dequantize with the copy back of the original (host -> device), all
from those measured rates (no overlap assumed).

Everything measured (every time, settings, environment) goes to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import (
    Timer,
    environment,
    gbps,
    median,
    pinned_bandwidth,
    synchronize,
    write_json,
)
from offload._core import _compress as codec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_calls(
    fn: Callable[[], None], device: torch.device, repeats: int, warmup: int
) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` calls, each timed alone."""
    timer = Timer(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = timer.mark()
        fn()
        end = timer.mark()
        synchronize(device)
        times.append(timer.elapsed_ms(start, end))
    return times


def bench_size(
    x: torch.Tensor, impls: list[str], repeats: int, warmup: int, label: str
) -> list[dict[str, Any]]:
    """Rows for one input tensor: quantize and dequantize with each implementation."""
    device = x.device
    n = x.numel()
    packed = torch.empty(codec.packed_nbytes(n), dtype=torch.uint8, device=device)
    out = torch.empty_like(x)
    orig_bytes = n * x.element_size()
    packed_bytes = packed.numel()
    fns = {
        ("quantize", "triton"): lambda: codec.quantize_triton(x, packed),
        ("dequantize", "triton"): lambda: codec.dequantize_triton(packed, out),
        ("quantize", "eager"): lambda: codec.quantize_eager(x, packed),
        ("dequantize", "eager"): lambda: codec.dequantize_eager(packed, out),
    }
    rows = []
    for impl in impls:
        for op in ("quantize", "dequantize"):
            if op == "dequantize":
                codec.quantize_eager(x, packed)  # decode real data
            times = time_calls(fns[(op, impl)], device, repeats, warmup)
            ms = median(times)
            rows.append(
                {
                    "size": label,
                    "op": op,
                    "impl": impl,
                    "dtype": str(x.dtype).removeprefix("torch."),
                    "numel": n,
                    "orig_bytes": orig_bytes,
                    "packed_bytes": packed_bytes,
                    "codes_16B_aligned": (packed.data_ptr() + 4 * -(-n // codec.BLOCK)) % 16 == 0,
                    "ms": times,
                    "ms_median": ms,
                    "gbps_moved": gbps(orig_bytes + packed_bytes, ms),
                    "gbps_of_input": gbps(orig_bytes, ms),
                    "packed_over_orig": packed_bytes / orig_bytes,
                }
            )
    return rows


def agreement(x: torch.Tensor) -> dict[str, bool]:
    """Triton vs eager on ``x``: packed bytes equal, decodes equal (bitwise)."""
    n = x.numel()
    a = torch.empty(codec.packed_nbytes(n), dtype=torch.uint8, device=x.device)
    b = torch.empty_like(a)
    codec.quantize_triton(x, a)
    codec.quantize_eager(x, b)
    ya, yb = torch.empty_like(x), torch.empty_like(x)
    codec.dequantize_triton(a, ya)
    codec.dequantize_eager(a, yb)
    view = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return {
        "packed_bitwise_equal": bool(torch.equal(a, b)),
        "decode_bitwise_equal": bool(torch.equal(ya.view(view), yb.view(view))),
    }


def floor(x: torch.Tensor, repeats: int, warmup: int) -> dict[str, Any]:
    """The memory floor of the codec on ``x``'s device: torch's own copy of ``x`` (one read
    and one write of its bytes) and its unscaled cast to e4m3fn (no block maximum, no
    scale); ``floor_ms_per_op``: the bytes a quantize (or dequantize) must move,
    ``orig + packed``, at the copy's rate, i.e. what a codec costs at best."""
    n = x.numel()
    orig = n * x.element_size()
    packed = codec.packed_nbytes(n)
    same = torch.empty_like(x)
    fp8 = torch.empty(n, dtype=torch.float8_e4m3fn, device=x.device)
    copy_ms = median(time_calls(lambda: same.copy_(x), x.device, repeats, warmup))
    cast_ms = median(time_calls(lambda: fp8.copy_(x), x.device, repeats, warmup))
    copy_gbps = gbps(2 * orig, copy_ms)
    return {
        "dtype": str(x.dtype).removeprefix("torch."),
        "numel": n,
        "copy_ms": copy_ms,
        "copy_gbps_moved": copy_gbps,
        "cast_to_fp8_ms": cast_ms,
        "cast_gbps_moved": gbps(orig + n, cast_ms),
        "floor_ms_per_op": (orig + packed) / (copy_gbps * 1e9) * 1e3,
    }


def sweep(x: torch.Tensor, repeats: int, warmup: int) -> list[dict[str, Any]]:
    """Triton kernels with other blocks per program and warps (``codec.TILING`` patched,
    the same tiling for both kernels; each row is one kernel)."""
    saved = dict(codec.TILING)
    rows = []
    try:
        for blocks in (8, 16, 32, 64):
            for warps in (4, 8):
                codec.TILING.update(quantize=(blocks, warps), dequantize=(blocks, warps))
                for row in bench_size(x, ["triton"], repeats, warmup, "sweep"):
                    row.update(blocks_per_program=blocks, num_warps=warps)
                    rows.append(row)
    finally:
        codec.TILING.update(saved)
    return rows


def print_rows(rows: list[dict[str, Any]], extra: tuple[str, ...] = ()) -> None:
    header = (
        f"{'size':<8} {'op':<11} {'impl':<7} {'dtype':<9} {'MiB':>8} {'ms':>9} "
        f"{'GB/s moved':>11} {'GB/s of input':>14} {'packed/orig':>12}"
    ) + "".join(f" {name:>8}" for name in extra)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size']:<8} {r['op']:<11} {r['impl']:<7} {r['dtype']:<9} "
            f"{r['orig_bytes'] / 2**20:>8.1f} {r['ms_median']:>9.3f} {r['gbps_moved']:>11.1f} "
            f"{r['gbps_of_input']:>14.1f} {r['packed_over_orig']:>12.3f}"
            + "".join(f" {r[name]:>8}" for name in extra)
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=float, default=None, help="704 on CUDA, 16 on the CPU")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16,fp16,fp32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="also other kernel tilings")
    parser.add_argument("--out", default="bench_codec.json")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --device cpu", file=sys.stderr)
        return 2
    mib = args.mib if args.mib is not None else (704.0 if device.type == "cuda" else 16.0)
    use_triton = device.type == "cuda" and codec.triton_supported(device)
    impls = ["triton", "eager"] if use_triton else ["eager"]
    if device.type == "cuda" and not use_triton:
        print(
            "triton is not installed or the GPU lacks hardware fp8 conversion (compute "
            "capability below 8.9): CUDA tensors take the eager path",
            file=sys.stderr,
        )

    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    sweep_rows: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    g = torch.Generator(device=device).manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = DTYPES[name.strip()]
        n = int(mib * 2**20) // torch.tensor([], dtype=dtype).element_size()
        n -= n % (4 * codec.BLOCK)  # a multiple of 4 blocks: the codes start 16-byte aligned
        base = torch.randn(n + 200, device=device, dtype=dtype, generator=g)
        for label, x in (("aligned", base[:n]), ("ragged", base)):
            rows += bench_size(x, impls, args.repeats, args.warmup, label)
            if use_triton:
                checks[f"{name} {label}"] = agreement(x)
        floors.append(floor(base[:n], args.repeats, args.warmup))
        if args.sweep and use_triton:
            sweep_rows += sweep(base[:n], args.repeats, args.warmup)
        del base

    link: dict[str, Any] = {}
    if device.type == "cuda":
        link = pinned_bandwidth(device, sizes=(256 * 2**20,))

    codec_state = (
        "triton kernels, (blocks of "
        f"{codec.BLOCK} per program, warps): {codec.TILING}, hardware fp8 conversion"
        if use_triton
        else "eager only"
    )
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {where}; {codec_state}")
    print_rows(rows)
    for key, value in checks.items():
        print(f"triton vs eager, {key}: {value}")
    for f in floors:
        print(
            f"floor, {f['dtype']}: torch copy {f['copy_ms']:.3f} ms ({f['copy_gbps_moved']:.0f} "
            f"GB/s moved), unscaled cast to fp8 {f['cast_to_fp8_ms']:.3f} ms; a codec op "
            f"moving orig + packed bytes at the copy's rate: {f['floor_ms_per_op']:.3f} ms"
        )
    if sweep_rows:
        print("\nsweep (triton, aligned size):")
        print_rows(sweep_rows, extra=("blocks_per_program", "num_warps"))
    offload_model = []
    if link:
        d2h = link["d2h"]["256 MiB"]["gbps"]
        h2d = link["h2d"]["256 MiB"]["gbps"]
        print(f"\npinned copies, 256 MiB: D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s")
        for r in rows:
            if r["impl"] != impls[0] or r["size"] != "aligned":
                continue
            rate = d2h if r["op"] == "quantize" else h2d
            plain_ms = r["orig_bytes"] / (rate * 1e9) * 1e3
            packed_ms = r["packed_bytes"] / (rate * 1e9) * 1e3
            entry = {
                "dtype": r["dtype"],
                "direction": "d2h" if r["op"] == "quantize" else "h2d",
                "copy_original_ms": plain_ms,
                "codec_plus_copy_packed_ms": r["ms_median"] + packed_ms,
            }
            offload_model.append(entry)
            print(
                f"{entry['direction']} {r['dtype']}: copy original {plain_ms:.2f} ms; "
                f"{r['op']} + copy packed {entry['codec_plus_copy_packed_ms']:.2f} ms "
                f"(codec {r['ms_median']:.2f} + copy {packed_ms:.2f})"
            )

    write_json(
        args.out,
        {
            "command": "PYTHONPATH=. python3 benchmarks/compress/bench_codec.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "settings": {**vars(args), "mib": mib, "impls": impls},
            "codec": {
                "block": codec.BLOCK,
                "tiling": dict(codec.TILING),
                "triton_supported": codec.triton_supported(device),
                "triton_failure": codec._triton_failure,
            },
            "environment": environment(device),
            "rows": rows,
            "triton_vs_eager": checks,
            "sweep": sweep_rows,
            "floor": floors,
            "pinned_bandwidth": link,
            "offload_model": offload_model,
            "wall_s": time.perf_counter() - started,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
