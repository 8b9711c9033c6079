"""Helpers shared by the benchmark scripts: timing, host-link bandwidth, copy times from
the profiler, the environment record and JSON output.

Scripts import it as ``benchmarks._common``: run them from the repository root with
``PYTHONPATH=.`` (``PYTHONPATH=. python3 benchmarks/<topic>/<script>.py``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

__all__ = [
    "GIB",
    "Timer",
    "copy_times_from_profiler",
    "environment",
    "gbps",
    "median",
    "pinned_bandwidth",
    "synchronize",
    "write_json",
]

GIB = 1024**3


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (which must not be empty)."""
    return float(statistics.median(values))


def gbps(nbytes: float, ms: float) -> float:
    """Bytes over milliseconds as GB/s (10^9 bytes per second)."""
    return nbytes / (ms * 1e-3) / 1e9


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (every stream); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    """Garbage collector off for the timed span (as ``timeit`` does)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def hf_step(
    model: Any, ids: torch.Tensor, off: Any = None, host: list[float] | None = None
) -> tuple[torch.Tensor, float]:
    """One step of a Hugging Face causal LM: gradients set to ``None``, forward with
    ``labels=ids`` inside ``off`` (an offloader, or ``None``) and backward. On a CUDA
    device timed with CUDA events after a synchronisation, elsewhere with the host clock.
    Returns the detached loss and the step's milliseconds; ``host``: a list to append
    the host's milliseconds to, from the call to the return of ``backward()`` (before
    any synchronisation)."""
    for p in model.parameters():
        p.grad = None
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    with off if off is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    host_ms = (time.perf_counter() - t0) * 1e3
    if host is not None:
        host.append(host_ms)
    if not cuda:
        return loss.detach(), host_ms
    end.record()
    end.synchronize()
    return loss.detach(), start.elapsed_time(end)


def time_methods(
    targets: Sequence[tuple[Any, Sequence[str]]], calls: dict[str, list[float]]
) -> Callable[[], None]:
    """Wrap each method ``name`` of each ``owner`` (a class or a module) of ``targets``
    with a ``perf_counter`` timer (about 0.1 us per call) adding to ``calls[label]``
    (``[calls, seconds]``; ``label`` is ``"Owner.name"``). Returns the function that
    puts the originals back."""
    undo: list[tuple[Any, str, Any]] = []
    for owner, names in targets:
        for name in names:
            f = getattr(owner, name)
            label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

            def timed(*args: Any, _f: Any = f, _label: str = label, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    entry = calls[_label]
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0

            functools.update_wrapper(timed, f)
            undo.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, timed)

    def restore() -> None:
        for owner, name, own in reversed(undo):
            if own is None:
                delattr(owner, name)  # it was inherited
            else:
                setattr(owner, name, own)

    return restore


class Timer:
    """Times spans of device work: CUDA events on a GPU, ``perf_counter`` on the CPU.

    Usage: ``synchronize``; ``a = timer.mark()``; work; ``b = timer.mark()``;
    ``synchronize``; ``timer.elapsed_ms(a, b)``. On a GPU the marks are events recorded
    on the current stream, so the span is device time from the first queued kernel to the
    last (the host must not run behind the device for this to equal the step time, which
    the synchronisation before ``a`` guarantees at the start).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A point in time: a recorded ``torch.cuda.Event`` or ``perf_counter`` seconds."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (the device must have passed ``end``)."""
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


def pinned_bandwidth(
    device: torch.device, sizes: Sequence[int] = (256 * 2**20, 2**30), repeats: int = 5
) -> dict[str, dict[str, Any]]:
    """Device -> pinned host and pinned host -> device copy bandwidth, one direction at
    a time, on the current stream, timed with CUDA events.

    Returns ``{"d2h": {label: {"bytes", "ms": [...], "gbps"}}, "h2d": {...}}`` where
    ``label`` is ``"256 MiB"`` / ``"1 GiB"`` and ``gbps`` is the median (10^9 B/s).
    """
    timer = Timer(device)
    result: dict[str, dict[str, Any]] = {"d2h": {}, "h2d": {}}
    for size in sizes:
        label = f"{size // 2**30} GiB" if size % 2**30 == 0 else f"{size // 2**20} MiB"
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        for direction, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            dst.copy_(src, non_blocking=True)  # warm-up
            times = []
            for _ in range(repeats):
                synchronize(device)
                start = timer.mark()
                dst.copy_(src, non_blocking=True)
                end = timer.mark()
                synchronize(device)
                times.append(timer.elapsed_ms(start, end))
            result[direction][label] = {
                "bytes": size,
                "ms": times,
                "gbps": gbps(size, median(times)),
            }
        del dev, host
    torch.cuda.empty_cache()
    return result


#: One letter per lever of ``offload.plan``, as the benchmarks write plans (``o..Ss...``).
LEVER_LETTERS = {
    "keep": ".",
    "offload": "o",
    "selective": "s",
    "checkpoint": "c",
    "selective_offload": "S",
    "checkpoint_offload": "C",
    "selective_offload_inputs": "i",
}
_LEVERS_BY_LETTER = {letter: lever for lever, letter in LEVER_LETTERS.items()}


def levers_of(code: str) -> list[str]:
    """The levers of a plan written with :data:`LEVER_LETTERS` (``"o.S"`` ->
    ``["offload", "keep", "selective_offload"]``)."""
    return [_LEVERS_BY_LETTER[c] for c in code]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def copy_times_from_profiler(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Run ``step`` once under ``torch.profiler`` and measure its host-link copies.

    Sums the device intervals of the ``Memcpy DtoH ...`` and ``Memcpy HtoD ...`` events
    (CUPTI records; overlapping copies of one direction counted once, as the union of
    their intervals). Returns ``{"d2h_ms", "h2d_ms", "d2h_count", "h2d_count",
    "codec_ms", "codec_count"}`` or ``{"error": ...}`` when the profiler is unavailable
    or recorded no copies. ``codec_ms``: the device time (union of intervals) of the
    kernels whose name contains ``quantize`` (the fp8 codec of ``compress="fp8"``,
    ``offload/_core/_compress.py``; it covers ``dequantize``), 0 without compression.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                synchronize(device)
        spans: dict[str, list[tuple[float, float]]] = {"d2h": [], "h2d": [], "codec": []}
        for evt in prof.events():
            if evt.device_type != DeviceType.CUDA:
                continue
            if "quantize" in evt.name:
                spans["codec"].append((evt.time_range.start, evt.time_range.end))
            for direction, prefix in (("d2h", "Memcpy DtoH"), ("h2d", "Memcpy HtoD")):
                if evt.name.startswith(prefix):
                    spans[direction].append((evt.time_range.start, evt.time_range.end))
    except Exception as exc:  # a profiler without CUPTI, a kineto error: report, go on
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "d2h_ms": union_length(spans["d2h"]) / 1e3,
        "h2d_ms": union_length(spans["h2d"]) / 1e3,
        "d2h_count": len(spans["d2h"]),
        "h2d_count": len(spans["h2d"]),
        "codec_ms": union_length(spans["codec"]) / 1e3,
        "codec_count": len(spans["codec"]),
    }


def _git_commit() -> str | None:
    """The checked-out commit of the repository this file lives in, if git knows it."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def source_digest() -> str:
    """SHA-1 over the package's Python files (relative paths and contents, sorted): names
    the code a result measured even where the checkout's commit does not (a copied tree
    with uncommitted changes, or a stale ``.git``)."""
    import offload

    root = Path(offload.__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, device and host facts for the JSON record."""
    import offload

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "offload": offload.__version__,
        "git_commit": _git_commit(),
        "source_sha1": source_digest(),
        "cpu_count": os.cpu_count(),
        "host_memory_total_gib": psutil.virtual_memory().total / GIB,
        "host_memory_available_gib": psutil.virtual_memory().available / GIB,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=torch.cuda.get_device_name(device),
            gpu_memory_gib=props.total_memory / GIB,
            gpu_capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    return env


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def results(benchmark: str, args: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A results document (the benchmark's name, command line, settings, environment on
    ``args.device``, rows), written to ``args.out`` when set."""
    out = {
        "benchmark": benchmark,
        "command": sys.argv,
        "settings": vars(args),
        "environment": environment(torch.device(args.device)),
        "rows": rows,
    }
    if args.out:
        write_json(args.out, out)
    return out


def llama_1b_config(max_positions: int) -> Any:
    """The "HF Llama ~1.1B" of the tables: ``transformers.LlamaConfig`` with hidden 2048,
    16 layers, 32 heads, 4 KV heads, ffn 5632, vocab 32000 (random weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=max_positions,
    )


def llama_1b(max_positions: int, device: str, tiny: bool = False) -> Any:
    """The model of :func:`llama_1b_config` in training mode (SDPA, no cache, seed 0):
    bf16 on CUDA, fp32 elsewhere; ``tiny``: 4 layers of hidden 64 and a vocabulary of
    128 (the CPU smoke runs of the diagnostics)."""
    import transformers

    torch.manual_seed(0)
    config = llama_1b_config(max_positions)
    if tiny:
        config.hidden_size, config.intermediate_size, config.num_hidden_layers = 64, 128, 4
        config.num_attention_heads, config.num_key_value_heads, config.vocab_size = 4, 1, 128
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return model.to(device, dtype).train()


def free_cached(device: torch.device) -> None:
    """Collect garbage and give the caching allocator's unused blocks back, so that the
    next configuration measured starts from the same device state (gradients stay)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
