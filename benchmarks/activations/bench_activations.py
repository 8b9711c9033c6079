"""Activation offloading on the "ref-8L" model: step time, activation memory, link traffic.

Command (one GPU, default sizes; about 50 s on an H200)::

    PYTHONPATH=. python3 benchmarks/activations/bench_activations.py --compress-ks 4,7 \\
        --out benchmarks/results/activations_ref8l.json

CPU smoke run (tiny sizes, one CPU thread, CUDA-only columns print n/a; a few seconds)::

    PYTHONPATH=. python3 benchmarks/activations/bench_activations.py --quick --device cpu --out /tmp/b.json

Many small layers (``--preset tiny48``: 48 layers, hidden 256, 4 heads, ffn 704, seq 256,
batch 4; median of 15 steps by default; its default rows: no offload, ``offload k=0``
(hooks only: every saved tensor goes through the offloader and stays), ``offload k=47``
(``offload_layers="all"``: all layers but the last), ``save_on_cpu``, checkpointing)::

    PYTHONPATH=. python3 benchmarks/activations/bench_activations.py --preset tiny48 --interleave 15 \\
        --out benchmarks/results/activations_tiny48.json

``--methods`` picks the kinds of rows (``none,offload,save_on_cpu,checkpoint``, all by
default; ``none`` always runs, it is the reference of ``x none``) and ``--ks`` the
``offload_layers`` values of the offload rows.

Model (docs/performance.md, "ref-8L", by default): L Llama-style layers, each
``x + out(SDPA_causal(qkv(RMSNorm(x))))`` then ``x + down(silu(gate) * up)`` with
``gate, up = gate_up(RMSNorm(x))`` (fused QKV and fused gate/up ``nn.Linear`` without
bias, ``nn.RMSNorm``, no RoPE); hidden 4096, 32 heads, ffn 14336, 8 layers, seq 4096,
batch 1, bf16 weights; loss = mean of squares of the last layer's output, in fp32.
The model is built once (seed 0) and every row uses the same weights.

Rows, all in this one process:

* ``no offload``;
* ``offload k=n``: ``offload.ActivationOffloader(layers, offload_layers=n)``, other
  settings at their defaults (``--quick`` sets ``min_tensor_bytes=0`` so that its tiny
  tensors are offloaded at all); the context covers the layers and the loss. ``k=L-1``
  is marked ``(default)`` when every other setting is the library's (it is what
  ``offload_layers=None`` does), ``k=0`` is marked ``(hooks only)``;
* ``offload k=L-1 double_buffering`` with ``--double-buffering-compare``;
* ``offload k=n fp8`` for each n of ``--compress-ks``: the same with ``compress="fp8"``
  (lossy: floating tensors travel as fp8 with a scale per 128 elements); ``D2H / step``
  counts the compressed bytes, ``codec ms`` (JSON ``profiled_step.codec_ms``) is the
  device time of the quantize and dequantize kernels in the profiled step;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the
  layers only (same scope as the offloader: the loss stays outside);
* ``checkpoint``: ``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)``
  around every layer.

A step is forward + backward (no optimizer step) on a fresh random input ``x`` that
does not require grad; the weights do. Each row runs ``--warmup`` steps, then ``--steps``
timed steps, then one memory step and (CUDA only) one profiled step.

Columns (definitions):

* ``step ms``: median over the timed steps of the device time of one step, CUDA events
  recorded on the compute stream around forward + backward after a device
  synchronisation (``perf_counter`` on the CPU). Gradients are set to ``None``
  (``zero_grad(set_to_none=True)``) before each timed step, outside the timed span, as an
  optimizer's ``zero_grad`` does. Every raw time and the host wall time are in the JSON.
* ``x none``: step ms / step ms of ``no offload`` measured in this process.
* ``model ms``: the docs/design.md section 6 bound for this k (see ``simulate_step_ms``),
  anchored on this run: no-offload step ms + (simulated step with offloading - simulated
  step without), from the measured F, B, S and W below.
* ``act GiB``: peak activation memory = ``torch.cuda.max_memory_allocated()`` during the
  memory step minus ``torch.cuda.memory_allocated()`` just before it. The memory step
  keeps the gradients of the previous step (its backward accumulates into them), so
  "before" holds weights + gradients + the input and the difference is what the step
  adds: saved activations, reload buffers and backward workspace (the definition of
  "activation memory" in docs/performance.md, section 1).
* ``peak GiB``: ``max_memory_allocated()`` over the timed steps (absolute, all included).
* ``D2H / step`` / ``H2D / step``: bytes sent each way in one step (the last timed step),
  printed in binary units (GiB = 2^30 B).
  Offloader: ``stats.bytes_offloaded`` / ``stats.bytes_reloaded``. save_on_cpu: the
  bytes of every tensor its pack hook copies and its unpack hook copies back, counted by
  wrapping torch's own hooks (they copy each saved tensor whole, weight views included).
* ``D2H GB/s`` / ``H2D GB/s``: achieved copy bandwidth = bytes of the profiled step /
  device time of its copies: the union of the ``Memcpy DtoH`` (``HtoD``) intervals that
  ``torch.profiler`` (CUPTI) records during that step; in brackets, as a share of the
  pinned memcpy bandwidth at 1 GiB measured at the start of this run. n/a when the
  profiler records no copies. The JSON also has "effective" GB/s = bytes / step time.

Also measured and printed: pinned memcpy bandwidth (device -> pinned host and back, 256
MiB and 1 GiB, median of 5, CUDA events); one layer alone (layer 0, input requiring
grad): forward time F and backward time B (CUDA events, median of 10); activation bytes
per layer S from the stats of the largest-k offload row (bytes offloaded per offloaded
layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from benchmarks._common import (
    GIB,
    Timer,
    copy_times_from_profiler,
    environment,
    gbps,
    median,
    pinned_bandwidth,
    synchronize,
    write_json,
)
from offload.profiling import format_bytes

DTYPE = torch.bfloat16
LAYER_REPEATS = 10  # timed repeats of the one-layer measurement
LAYER_WARMUP = 3


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the benchmarked model."""

    hidden: int = 4096
    heads: int = 32
    ffn: int = 14336
    layers: int = 8
    seq: int = 4096
    batch: int = 1


QUICK = ModelConfig(hidden=64, heads=4, ffn=128, layers=4, seq=32, batch=1)


def _ref_ks(num_layers: int) -> list[int | str]:
    return [*sorted({k for k in (1, 2, 4, num_layers - 1) if 1 <= k <= num_layers - 1}), "auto"]


def _tiny48_ks(num_layers: int) -> list[int | str]:
    return [*sorted({0, num_layers - 1}), "auto"]


#: ``--preset`` name -> (sizes, default --steps, default --ks as a function of L, its text)
PRESETS: dict[str, tuple[ModelConfig, int, Callable[[int], list[int]], str]] = {
    "ref-8L": (ModelConfig(), 7, _ref_ks, "1,2,4,L-1 within 1..L-1"),
    "tiny48": (
        ModelConfig(hidden=256, heads=4, ffn=704, layers=48, seq=256, batch=4),
        15,
        _tiny48_ks,
        "0,L-1",
    ),
}
METHODS = ("none", "offload", "save_on_cpu", "checkpoint")


class Block(nn.Module):
    """One Llama-style layer: pre-norm causal attention and SwiGLU MLP, residuals."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": DTYPE}
        self.heads = cfg.heads
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=1e-5, **kw)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False, **kw)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False, **kw)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=1e-5, **kw)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False, **kw)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def run_layers(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """The layers in order."""
    for layer in layers:
        x = layer(x)
    return x


def loss_of(y: torch.Tensor) -> torch.Tensor:
    """Mean of squares of ``y``, computed in fp32."""
    return y.float().square().mean()


# --------------------------------------------------------------------------------------
# rows


class Runner:
    """One row of the table: how the forward of a step runs (the backward is shared)."""

    name = "no offload"

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """Forward of one step; returns the loss."""
        return loss_of(run_layers(self.layers, x))

    def traffic(self) -> tuple[int, int]:
        """Bytes (to host, back to device) of the most recent step."""
        return 0, 0

    def details(self) -> dict[str, Any]:
        """Extra JSON-ready facts about the most recent step."""
        return {}

    def close(self) -> None:
        """Release what the row holds (host memory, hooks)."""


class Offloaded(Runner):
    """``offload.ActivationOffloader`` with ``offload_layers=k``; context over layers + loss."""

    def __init__(
        self,
        layers: nn.ModuleList,
        k: int | str,
        *,
        double_buffering: bool,
        min_tensor_bytes: int | None,
        compress: str | None = None,
    ) -> None:
        super().__init__(layers)
        kwargs: dict[str, Any] = {"offload_layers": k}
        if double_buffering:
            kwargs["double_buffering"] = True
        if compress is not None:
            kwargs["compress"] = compress
        if min_tensor_bytes is not None:
            kwargs["min_tensor_bytes"] = min_tensor_bytes
        self.offloader = offload.ActivationOffloader(layers, **kwargs)
        self.name = f"offload k={k}" + (" double_buffering" if double_buffering else "")
        if k == "auto":
            self.name = "offload auto" + (" (default)" if min_tensor_bytes is None else "")
        elif k == 0:
            self.name += " (hooks only)"
        elif k == len(layers) - 1:
            self.name += " (all)"
        if compress is not None:
            self.name += f" {compress}"

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        with self.offloader:
            return loss_of(run_layers(self.layers, x))

    def traffic(self) -> tuple[int, int]:
        stats = self.offloader.stats
        return stats.bytes_offloaded, stats.bytes_reloaded

    def details(self) -> dict[str, Any]:
        stats = self.offloader.stats
        out: dict[str, Any] = {"stats": stats.to_dict()}
        if stats.auto is not None:  # offload_layers="auto": what it chose
            out["auto_k"] = sum(1 for la in stats.layers if la.offloaded)
        return out

    def close(self) -> None:
        self.offloader.close()


class SaveOnCpu(Runner):
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the layers only.

    Its own pack/unpack hooks do the work; thin wrappers count the bytes they copy.
    """

    name = "save_on_cpu(pin_memory=True)"

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__(layers)
        inner = torch.autograd.graph.save_on_cpu(pin_memory=True)
        pack, unpack = inner.pack_hook, inner.unpack_hook
        self.sent = self.received = 0

        def counting_pack(t: torch.Tensor) -> Any:
            self.sent += t.numel() * t.element_size()
            return pack(t)

        def counting_unpack(packed: Any) -> torch.Tensor:
            host = packed[1]
            self.received += host.numel() * host.element_size()
            return unpack(packed)

        self.hooks = torch.autograd.graph.saved_tensors_hooks(counting_pack, counting_unpack)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        self.sent = self.received = 0
        with self.hooks:
            y = run_layers(self.layers, x)
        return loss_of(y)

    def traffic(self) -> tuple[int, int]:
        return self.sent, self.received


class Checkpointed(Runner):
    """Full activation checkpointing: every layer under non-reentrant ``checkpoint``."""

    name = "checkpoint (every layer)"

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return loss_of(x)


# --------------------------------------------------------------------------------------
# measurements


@dataclasses.dataclass
class Bench:
    """What every measurement needs: the model, its sizes, the device, the timer."""

    layers: nn.ModuleList
    cfg: ModelConfig
    device: torch.device
    timer: Timer

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def new_input(self, requires_grad: bool = False) -> torch.Tensor:
        c = self.cfg
        return torch.randn(
            c.batch, c.seq, c.hidden, device=self.device, dtype=DTYPE, requires_grad=requires_grad
        )

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def free(self) -> None:
        """Drop gradients and cached device blocks between rows."""
        self.layers.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def time_one_layer(bench: Bench) -> dict[str, Any]:
    """Forward and backward time of layer 0 alone on an input that requires grad."""
    layer = bench.layers[0]
    fwd, bwd = [], []
    for i in range(LAYER_WARMUP + LAYER_REPEATS):
        layer.zero_grad(set_to_none=True)
        x = bench.new_input(requires_grad=True)
        grad = torch.randn_like(x)
        synchronize(bench.device)
        start = bench.timer.mark()
        y = layer(x)
        mid = bench.timer.mark()
        y.backward(grad)
        end = bench.timer.mark()
        synchronize(bench.device)
        if i >= LAYER_WARMUP:
            fwd.append(bench.timer.elapsed_ms(start, mid))
            bwd.append(bench.timer.elapsed_ms(mid, end))
        del x, grad, y
    bench.free()
    return {
        "forward_ms": fwd,
        "backward_ms": bwd,
        "forward_ms_median": median(fwd),
        "backward_ms_median": median(bwd),
    }


def allocator_counts(device: torch.device) -> dict[str, int]:
    """Cumulative counters of PyTorch's CUDA caching allocator."""
    stats = torch.cuda.memory_stats(device)
    return {
        "requests": stats.get("allocation.all.allocated", 0),
        "cuda_malloc": stats.get("segment.all.allocated", 0),
        "retries": stats.get("num_alloc_retries", 0),
    }


def timed_step(bench: Bench, runner: Runner) -> tuple[float, float]:
    """One step of ``runner`` on a fresh input, gradients set to ``None`` first:
    ``(device ms, host wall ms)``, with a device synchronisation at each end."""
    bench.layers.zero_grad(set_to_none=True)
    x = bench.new_input()
    synchronize(bench.device)
    wall_start = time.perf_counter()
    start = bench.timer.mark()
    runner.loss(x).backward()
    end = bench.timer.mark()
    synchronize(bench.device)
    return bench.timer.elapsed_ms(start, end), (time.perf_counter() - wall_start) * 1e3


def measure_row(bench: Bench, runner: Runner, steps: int, warmup: int) -> dict[str, Any]:
    """Warm-up, timed steps, one memory step and (CUDA) one profiled step of ``runner``."""

    def step(x: torch.Tensor) -> None:
        runner.loss(x).backward()

    for _ in range(warmup):
        bench.layers.zero_grad(set_to_none=True)
        step(bench.new_input())
    synchronize(bench.device)
    if bench.cuda:
        bench.reset_peak()

    step_ms, wall_ms, sent, received = [], [], [], []
    for _ in range(steps):
        device_ms, host_ms = timed_step(bench, runner)
        step_ms.append(device_ms)
        wall_ms.append(host_ms)
        d2h, h2d = runner.traffic()
        sent.append(d2h)
        received.append(h2d)
    row: dict[str, Any] = {
        "name": runner.name,
        "step_ms": step_ms,
        "wall_ms": wall_ms,
        "step_ms_median": median(step_ms),
        "bytes_d2h": sent,
        "bytes_h2d": received,
        "details": runner.details(),
    }
    if not bench.cuda:
        return row

    row["peak_allocated_gib"] = bench.peak() / GIB
    # Memory step: the timed steps' gradients stay, so "before" = weights + grads + input.
    x = bench.new_input()
    synchronize(bench.device)
    before = bench.allocated()
    counts_before = allocator_counts(bench.device)
    bench.reset_peak()
    step(x)
    synchronize(bench.device)
    counts_after = allocator_counts(bench.device)
    # allocator calls of one step: requests served (from the cache or not), device
    # segments created (cudaMalloc) and allocation retries (cache flushes)
    row["allocator_step"] = {k: counts_after[k] - counts_before[k] for k in counts_after}
    row["memory_step"] = {
        "before_gib": before / GIB,
        "peak_gib": bench.peak() / GIB,
        "params_and_grads_gib": sum(
            p.nbytes + (p.grad.nbytes if p.grad is not None else 0)
            for p in bench.layers.parameters()
        )
        / GIB,
    }
    row["activation_gib"] = (bench.peak() - before) / GIB
    del x

    bench.layers.zero_grad(set_to_none=True)
    x = bench.new_input()
    copies = copy_times_from_profiler(lambda: step(x), bench.device)
    d2h, h2d = runner.traffic()
    copies.update(bytes_d2h=d2h, bytes_h2d=h2d)
    row["profiled_step"] = copies
    return row


# --------------------------------------------------------------------------------------
# the performance model (docs/design.md, section 6)


def simulate_step_ms(
    num_layers: int,
    offloaded: Sequence[int],
    fwd_ms: float,
    bwd_ms: float,
    layer_bytes: Sequence[float],
    d2h_gbps: float,
    h2d_gbps: float,
) -> float:
    """Predicted forward + backward time with the groups ``offloaded`` (sorted) offloaded.

    Event simulation of docs/design.md, sections 3 and 6: one compute stream (each layer F ms
    forward, B ms backward) and one copy stream per direction running its copies in
    order. Offloaded group ``s_j`` (the j-th of k):

    * D2H: starts when layer s_j's forward starts and the D2H stream is free; takes
      ``S/W_d2h``; cannot end before that forward ends (the last tensor is saved then).
    * release: layer ``r_j = max(s_j + 1, L - k + j)`` starts its forward only after that
      D2H ended (the end of the forward waits when ``r_j = L``).
    * H2D: issued when the backward of layer ``q_j = min(L - 1, max(s_j + 1, L - 1 - k +
      j))`` starts (its output gradient arrived), runs when the H2D stream is free, takes
      ``S/W_h2d``; layer s_j's backward starts only after it ended.

    Returns the time from the first forward to the end of the last backward, in ms.
    """
    L, k = num_layers, len(offloaded)
    release_at: dict[int, list[int]] = {}
    reload_at: dict[int, list[int]] = {}
    for j, s in enumerate(offloaded):
        release_at.setdefault(max(s + 1, L - k + j), []).append(s)
        reload_at.setdefault(min(L - 1, max(s + 1, L - 1 - k + j)), []).append(s)
    d2h_ms = [b / (d2h_gbps * 1e9) * 1e3 for b in layer_bytes]
    h2d_ms = [b / (h2d_gbps * 1e9) * 1e3 for b in layer_bytes]
    chosen = set(offloaded)

    t = d2h_free = 0.0
    d2h_end: dict[int, float] = {}
    for i in range(L + 1):  # i == L: the end of the forward
        for s in release_at.get(i, []):
            t = max(t, d2h_end[s])
        if i == L:
            break
        if i in chosen:
            begin = max(t, d2h_free)
            d2h_free = d2h_end[i] = max(begin + d2h_ms[i], t + fwd_ms)
        t += fwd_ms

    h2d_free = 0.0
    h2d_end: dict[int, float] = {}
    for i in reversed(range(L)):
        for s in sorted(reload_at.get(i, []), reverse=True):  # needed first, copied first
            h2d_free = h2d_end[s] = max(t, h2d_free) + h2d_ms[s]
        if i in chosen:
            t = max(t, h2d_end[i])
        t += bwd_ms
    return t


def largest_k_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The offload row (without double buffering) with the largest k > 0 that sent bytes."""
    candidates = [
        r
        for r in rows
        if r["method"] == "offload"
        and isinstance(r["k"], int)
        and r["k"]
        and not r["double_buffering"]
        and not r.get("compress")
        and r["bytes_d2h"][-1]
    ]
    return max(candidates, key=lambda r: r["k"], default=None)


def layer_bytes(row: dict[str, Any]) -> list[float]:
    """Per-layer offloaded bytes S from an offload row's stats; layers that row did not
    offload get the mean of those it did."""
    layers = row["details"]["stats"]["layers"]
    sent = [la["bytes_offloaded"] for la in layers if la["offloaded"]]
    mean = sum(sent) / len(sent)
    return [float(la["bytes_offloaded"]) if la["offloaded"] else mean for la in layers]


def add_predictions(result: dict[str, Any]) -> None:
    """Fill ``result["model"]`` and each offload row's ``model_ms`` / ``model_raw_ms``.

    Needs the pinned bandwidth (CUDA) and an offload row that sent bytes; otherwise the
    model columns stay n/a.
    """
    rows, lay = result["rows"], result["layer"]
    source = largest_k_row(rows)
    if source is None:
        return
    sizes = layer_bytes(source)
    lay["activation_bytes_per_layer"] = source["bytes_d2h"][-1] / source["k"]
    lay["bytes_source"] = source["name"]
    pinned = result.get("pinned_1gib_gbps")
    if not pinned:
        return
    num_layers = result["settings"]["model"]["layers"]
    fwd, bwd = lay["forward_ms_median"], lay["backward_ms_median"]

    def simulate(offloaded: list[int], sizes: list[float] = sizes) -> float:
        return simulate_step_ms(
            num_layers, offloaded, fwd, bwd, sizes, pinned["d2h"], pinned["h2d"]
        )

    plain = simulate([])
    result["model"] = {
        "F_ms": fwd,
        "B_ms": bwd,
        "S_bytes": sizes,
        "W_gbps": pinned,
        "no_offload_ms": plain,
    }
    none_ms = rows[0]["step_ms_median"]
    for row in rows:
        if row["method"] == "offload":
            k = row["k"] if isinstance(row["k"], int) else row["details"].get("auto_k")
            if k is None:
                continue
            # compressed rows: the bytes that row sent (the codec's kernels not modelled)
            own = layer_bytes(row) if row.get("compress") and k else sizes
            row["model_raw_ms"] = simulate(list(range(k)), own)
            row["model_ms"] = none_ms + row["model_raw_ms"] - plain


def add_bandwidths(result: dict[str, Any]) -> None:
    """Per row: achieved GB/s (profiled copy time) and effective GB/s (step time)."""
    for row in result["rows"]:
        row["effective_gbps"] = {
            d: row[f"bytes_{d}"][-1] / (row["step_ms_median"] * 1e-3) / 1e9 for d in ("d2h", "h2d")
        }
        prof = row.get("profiled_step") or {}
        row["achieved_gbps"] = {
            d: gbps(prof[f"bytes_{d}"], prof[f"{d}_ms"])
            if prof.get(f"{d}_ms") and prof[f"bytes_{d}"]
            else None
            for d in ("d2h", "h2d")
        }


# --------------------------------------------------------------------------------------
# report


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _achieved(row: dict[str, Any], direction: str, pinned: float | None) -> str:
    """``"52.1 (95%)"``: achieved GB/s of the profiled step and share of pinned memcpy."""
    if row["bytes_" + direction][-1] == 0:
        return "-"
    rate = row["achieved_gbps"][direction]
    if rate is None:
        return "n/a"
    return f"{rate:.1f}" + (f" ({rate / pinned:.0%})" if pinned else "")


def _allocs(row: dict[str, Any]) -> str:
    counts = row.get("allocator_step")
    if not counts:
        return "n/a"
    return f"{counts['requests']} ({counts['cuda_malloc']} new)"


def print_report(result: dict[str, Any]) -> None:
    """Print the header lines, the table and the notes with rich."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    env, cfg = result["environment"], result["settings"]["model"]
    where = f"{env['gpu']} ({env['device']})" if "gpu" in env else env["device"]
    console.print(
        f"[bold]bench_activations[/bold]: {result['settings']['model_name']} "
        f"(hidden {cfg['hidden']}, heads {cfg['heads']}, ffn {cfg['ffn']}, "
        f"{cfg['layers']} layers, seq {cfg['seq']}, batch {cfg['batch']}, bf16) on {where}, "
        f"torch {env['torch']} (CUDA {env['torch_cuda'] or 'n/a'}), "
        f"offload {env['offload']}"
    )
    memcpy = result["memcpy"]
    if memcpy:
        parts = [
            f"{direction.upper()} "
            + ", ".join(f"{label} {m['gbps']:.1f}" for label, m in memcpy[direction].items())
            for direction in ("d2h", "h2d")
        ]
        console.print("pinned memcpy GB/s (median of 5): " + "; ".join(parts))
    else:
        console.print("pinned memcpy GB/s: n/a (no CUDA device)")
    lay = result["layer"]
    per_layer = lay.get("activation_bytes_per_layer")
    model = result.get("model")
    copy = (
        f"; one-way copy S/W {per_layer / (model['W_gbps']['d2h'] * 1e6):.1f} ms" if model else ""
    )
    console.print(
        f"one layer alone (median of {LAYER_REPEATS}): forward F "
        f"{lay['forward_ms_median']:.2f} ms, backward B {lay['backward_ms_median']:.2f} ms; "
        f"activations offloaded per layer S "
        f"{_fmt(None if per_layer is None else per_layer / 2**20, '.1f')} MiB "
        f"(stats of {lay.get('bytes_source', 'n/a')}){copy}"
    )

    pinned = result.get("pinned_1gib_gbps") or {}
    clock = "CUDA events" if env["device"].startswith("cuda") else "perf_counter"
    table = Table(title="forward + backward step (no optimizer)")
    for col in (
        "method",
        "step ms",
        "x none",
        "model ms",
        "act GiB",
        "peak GiB",
        "allocs / step",
        "D2H / step",
        "H2D / step",
        "D2H GB/s (% pinned)",
        "H2D GB/s (% pinned)",
    ):
        table.add_column(col, justify="left" if col == "method" else "right")
    for row in result["rows"]:
        d2h, h2d = row["bytes_d2h"][-1], row["bytes_h2d"][-1]
        table.add_row(
            row["name"],
            f"{row['step_ms_median']:.1f}",
            f"{row['ratio_to_none']:.2f}",
            _fmt(row.get("model_ms"), ".1f"),
            _fmt(row.get("activation_gib"), ".2f"),
            _fmt(row.get("peak_allocated_gib"), ".2f"),
            _allocs(row),
            format_bytes(d2h),
            format_bytes(h2d),
            _achieved(row, "d2h", pinned.get("d2h")),
            _achieved(row, "h2d", pinned.get("h2d")),
        )
    console.print(table)
    console.print(
        f"step ms: median of {result['settings']['steps']} timed steps after "
        f"{result['settings']['warmup']} warm-up ({clock}); act GiB: peak allocated "
        "during a step minus allocated before it (weights + grads + input); allocs / step: "
        "caching-allocator requests of the memory step (cudaMalloc calls); model ms: "
        "docs/design.md section 6 bound from F, B, S and pinned 1 GiB W, anchored on the "
        "measured no-offload step; GB/s: bytes / profiler copy time. Definitions: header "
        "of benchmarks/activations/bench_activations.py."
    )


# --------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    size = parser.add_argument_group("model sizes (default: the preset's; --quick: tiny)")
    size.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="ref-8L",
        help="model sizes, default --steps and --ks: "
        + "; ".join(
            f"{name}: {dataclasses.asdict(cfg)}, {steps} steps, ks {ks}"
            for name, (cfg, steps, _, ks) in PRESETS.items()
        ),
    )
    for name in ("hidden", "ffn", "heads", "layers", "seq", "batch"):
        size.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per row (>= 5; default: preset's)"
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated kinds of rows among " + ",".join(METHODS) + " (none always runs)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per row (>= 1)")
    parser.add_argument(
        "--ks",
        default=None,
        help="comma-separated offload_layers values, 0 <= k <= L or 'auto' (default: the preset's)",
    )
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="after the rows, time ROUNDS rounds of one step of every row in turn "
        "(round-robin: slow drifts of a shared host hit every row alike); 0: skip",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--compress-ks",
        default="",
        help="comma-separated offload_layers values also run with compress='fp8' "
        "(rows 'offload k=n fp8'; default: none)",
    )
    parser.add_argument(
        "--staging-slots",
        type=int,
        default=None,
        help="device staging slots per direction of the fp8 rows (offload._core._device."
        "STAGING_SLOTS; default: the library's)",
    )
    parser.add_argument(
        "--chunk-elements",
        type=int,
        default=None,
        help="elements per chunk of the fp8 rows' copies, a multiple of 128 (offload."
        "_device.CHUNK_ELEMENTS; default: the library's); larger chunks: fewer codec "
        "launches per layer, larger staging slots",
    )
    parser.add_argument(
        "--double-buffering-compare",
        action="store_true",
        help="also run k=L-1 with double_buffering=True",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny sizes for a smoke run ({dataclasses.asdict(QUICK)}), min_tensor_bytes=0",
    )
    parser.add_argument(
        "--min-tensor-bytes",
        type=int,
        default=None,
        help="min_tensor_bytes for the offloader (default: the library's; --quick: 0)",
    )
    args = parser.parse_args(argv)
    if args.staging_slots is not None and args.staging_slots < 1:
        parser.error(f"--staging-slots must be >= 1; got {args.staging_slots}")
    if args.chunk_elements is not None and (args.chunk_elements < 128 or args.chunk_elements % 128):
        parser.error(
            f"--chunk-elements must be a positive multiple of 128 (the codec's block); got "
            f"{args.chunk_elements}"
        )

    if args.quick and args.preset != "ref-8L":
        parser.error("--quick and --preset are exclusive (--quick has its own tiny sizes)")
    preset, preset_steps, preset_ks, _ = PRESETS[args.preset]
    base = QUICK if args.quick else preset
    if args.steps is None:
        args.steps = preset_steps
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; accepted: {','.join(METHODS)}")
    args.methods = [m for m in METHODS if m in methods or m == "none"]
    args.model = dataclasses.replace(
        base,
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(ModelConfig)
            if getattr(args, f.name) is not None
        },
    )
    if args.quick and args.min_tensor_bytes is None:
        args.min_tensor_bytes = 0
    L = args.model.layers
    if "offload" not in args.methods:
        args.ks = []
    elif args.ks is None:
        args.ks = preset_ks(L)
    else:
        try:
            args.ks = [
                k.strip() if k.strip() == "auto" else int(k)
                for k in args.ks.split(",")
                if k.strip()
            ]
        except ValueError:
            parser.error(f"--ks must be comma-separated ints or 'auto'; got {args.ks!r}")
        bad = [k for k in args.ks if k != "auto" and not 0 <= k <= L]
        if bad:
            parser.error(f"--ks values {bad} out of range: 0 <= k <= layers = {L}")
    try:
        args.compress_ks = [int(k) for k in args.compress_ks.split(",") if k.strip()]
    except ValueError:
        parser.error(f"--compress-ks must be comma-separated ints; got {args.compress_ks!r}")
    if any(not 0 <= k <= L for k in args.compress_ks):
        parser.error(f"--compress-ks values must be 0 <= k <= layers = {L}")
    if args.steps < 5:
        parser.error(f"--steps {args.steps}: at least 5 timed steps")
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: at least 1 (gradients must exist)")
    if args.model.hidden % args.model.heads:
        parser.error(f"--hidden {args.model.hidden} is not divisible by --heads {args.model.heads}")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu (with --quick)")
    if args.device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device}: only cuda and cpu are supported")
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    return args


def runners(
    layers: nn.ModuleList, args: argparse.Namespace
) -> Iterator[tuple[Runner, dict[str, Any]]]:
    """The rows in order, each made only when the previous one is done, with its tags."""
    yield Runner(layers), {"method": "none"}
    variants = [(k, False) for k in args.ks]
    if args.double_buffering_compare and args.model.layers > 1:
        variants.append((args.model.layers - 1, True))
    for k, double in variants:
        runner = Offloaded(
            layers, k, double_buffering=double, min_tensor_bytes=args.min_tensor_bytes
        )
        yield runner, {"method": "offload", "k": k, "double_buffering": double}
    for k in args.compress_ks:
        runner = Offloaded(
            layers,
            k,
            double_buffering=False,
            min_tensor_bytes=args.min_tensor_bytes,
            compress="fp8",
        )
        yield runner, {"method": "offload", "k": k, "double_buffering": False, "compress": "fp8"}
    if "save_on_cpu" in args.methods:
        yield SaveOnCpu(layers), {"method": "save_on_cpu"}
    if "checkpoint" in args.methods:
        yield Checkpointed(layers), {"method": "checkpoint"}


def interleaved(bench: Bench, args: argparse.Namespace, rounds: int) -> dict[str, Any]:
    """Every row's step in turn, ``rounds`` times (after ``args.warmup`` steps of each):
    the medians, and their ratios to the no-offload row, printed and returned."""
    made = list(runners(bench.layers, args))
    times: list[list[float]] = [[] for _ in made]
    for runner, _ in made:
        for _ in range(args.warmup):
            timed_step(bench, runner)
    for _ in range(rounds):
        for i, (runner, _) in enumerate(made):
            times[i].append(timed_step(bench, runner)[0])
    none = median(times[0])
    out = {
        "rounds": rounds,
        "rows": [
            tags
            | {
                "name": r.name,
                "step_ms": t,
                "step_ms_median": median(t),
                "ratio_to_none": median(t) / none,
            }
            for (r, tags), t in zip(made, times)
        ],
    }
    print(f"interleaved: {rounds} rounds, one step of each row per round (medians)")
    for row in out["rows"]:
        print(f"  {row['name']:<32}{row['step_ms_median']:>9.2f} ms {row['ratio_to_none']:>7.2f}x")
    for runner, _ in made:
        runner.close()
    return out


def model_name(args: argparse.Namespace) -> str:
    """``ref-8L``, ``tiny48``, ``quick``, or one of them followed by ``(custom sizes)``."""
    name = "quick" if args.quick else args.preset
    base = QUICK if args.quick else PRESETS[args.preset][0]
    return name if args.model == base else f"{name} (custom sizes)"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device, cfg = args.device, args.model
    from offload._core import _device

    if args.staging_slots is not None:
        _device.STAGING_SLOTS = args.staging_slots
    if args.chunk_elements is not None:
        _device.CHUNK_ELEMENTS = args.chunk_elements
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif args.quick:
        torch.set_num_threads(1)  # tiny ops: threads only add contention
    result: dict[str, Any] = {
        "benchmark": "bench_activations",
        "command": [sys.executable, *sys.argv],
        "settings": {
            "model_name": model_name(args),
            "methods": args.methods,
            "model": dataclasses.asdict(cfg),
            "dtype": str(DTYPE),
            "steps": args.steps,
            "warmup": args.warmup,
            "ks": args.ks,
            "double_buffering_compare": args.double_buffering_compare,
            "compress_ks": args.compress_ks,
            "staging_slots": _device.STAGING_SLOTS,
            "chunk_elements": _device.CHUNK_ELEMENTS,
            "min_tensor_bytes": args.min_tensor_bytes,
            "quick": args.quick,
            "cpu_threads": torch.get_num_threads(),
        },
        "environment": environment(device),
    }
    result["memcpy"] = pinned_bandwidth(device) if device.type == "cuda" else None
    if result["memcpy"]:
        result["pinned_1gib_gbps"] = {
            d: result["memcpy"][d]["1 GiB"]["gbps"] for d in ("d2h", "h2d")
        }

    torch.manual_seed(0)
    layers = nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers))
    bench = Bench(layers, cfg, device, Timer(device))
    result["layer"] = time_one_layer(bench)

    rows: list[dict[str, Any]] = []
    for runner, tags in runners(layers, args):
        rows.append(tags | measure_row(bench, runner, args.steps, args.warmup))
        runner.close()
        del runner
        bench.free()
    for row in rows:
        row["ratio_to_none"] = row["step_ms_median"] / rows[0]["step_ms_median"]
    result["rows"] = rows
    add_bandwidths(result)
    add_predictions(result)
    print_report(result)
    if args.interleave:
        result["interleaved"] = interleaved(bench, args, args.interleave)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
