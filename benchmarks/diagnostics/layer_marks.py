"""Where one offloaded layer's cost lands in an HF Llama step: host and device time at
every layer boundary, with and without offloading, and the offloader's host time.

Command (one H200, about 30 s)::

    PYTHONPATH=. python3 benchmarks/diagnostics/layer_marks.py --out layer_marks.json

Model: ``benchmarks._common.llama_1b_config`` (HF Llama ~1.1B, SDPA, bf16, random
weights, batch 1), ``--lengths`` tokens. Four configurations, one step of each in turn
for ``--blocks`` rounds (the order reversed every other round) after three warm-up
rounds: ``none`` (no offloader), ``one`` (``offload_layers=1``), ``nocopy`` (the same
with a ``tensor_filter`` that keeps every tensor: hooks and placement, no copy) and
``big`` (``min_tensor_bytes`` 32 MiB: the same bytes in fewer, larger copies). Per step,
marks at each layer's forward pre-hook (``f<i>``) and forward hook (``e<i>``), at the
forward's end and at the backward's end: the host's ms (``perf_counter``, no
synchronisation inside the step) and the device's ms (a CUDA event recorded there; on
the CPU the host's again) from the step's start. Printed: the median of each mark per
configuration, host then device. Where a configuration's device mark moves past the
same mark of ``none``, its extra time lies before that mark; a device mark equal to its
host mark means the device waited for the host there.

The offloader's functions (placement, copies, group open and close, release, reload,
the context) are wrapped with ``perf_counter`` for the whole run (about 0.1 us per call
added): calls per step and ms per step, over the steps of the three offloading
configurations. ``sync``: synchronising CUDA calls in one step of each of ``none`` and
``one`` (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import offload
from benchmarks._common import llama_1b, results, time_methods
from offload import activations

#: (owner, method names) wrapped with a timer
from offload._core import _device, _host_pool
from offload.activations import _group, _layer_calls, _saves, _step

TIMED: list[tuple[Any, list[str]]] = [
    (_saves.Saves, ["pack", "_place_deferred", "_place", "_copy", "_flush_d2h", "_queue_d2h"]),
    (_step.Step, ["open_group", "close_group", "register_trigger", "finish_forward"]),
    (_step.Step, ["_backward_started"]),
    (_group.GroupLife, ["_release", "_reload"]),
    (_host_pool.HostPool, ["allocate"]),
    (_device.CudaBackend, ["d2h", "h2d", "record_d2h", "alloc"]),
    (_layer_calls.LayerCalls, ["_layer_start", "_layer_end"]),
    (activations.ActivationOffloader, ["__enter__", "__exit__"]),
]

CONFIGS = ("none", "one", "nocopy", "big")


def _keep_all(_t: torch.Tensor) -> bool:
    return False


class Marks:
    """Host and device marks of one step, taken by hooks on every layer."""

    def __init__(self, layers: Sequence[torch.nn.Module], cuda: bool) -> None:
        self.cuda = cuda
        self.rec: list[tuple[str, float, Any]] | None = None
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(
                layer.register_forward_pre_hook(functools.partial(self._pre, i), with_kwargs=True)
            )
            self.handles.append(
                layer.register_forward_hook(functools.partial(self._post, i), with_kwargs=True)
            )

    def mark(self, name: str) -> None:
        if self.rec is None:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.rec.append((name, time.perf_counter(), event))

    def _pre(self, i: int, _m: Any, _a: Any, _k: Any) -> None:
        self.mark(f"f{i}")

    def _post(self, i: int, _m: Any, _a: Any, _k: Any, _out: Any) -> None:
        self.mark(f"e{i}")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def step(model: Any, ids: torch.Tensor, off: Any, marks: Marks) -> dict[str, tuple[float, float]]:
    """One step (gradients set to ``None``, forward with ``labels=ids`` under ``off``,
    backward); returns ``{mark: (host ms, device ms)}`` from the step's start."""
    for p in model.parameters():
        p.grad = None
    if marks.cuda:
        torch.cuda.synchronize()
    marks.rec = []
    marks.mark("start")
    with off if off is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    marks.mark("fwd_end")
    loss.backward()
    marks.mark("end")
    rec, marks.rec = marks.rec, None
    if marks.cuda:
        rec[-1][2].synchronize()
    _, h0, e0 = rec[0]
    out = {}
    for name, h, e in rec[1:]:
        host = (h - h0) * 1e3
        out[name] = (host, e0.elapsed_time(e) if marks.cuda else host)
    return out


def measure(model: Any, layers: Sequence[Any], seq: int, args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    gen = torch.Generator(args.device).manual_seed(seq)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), device=args.device, generator=gen)
    offs: dict[str, Any] = {
        "none": None,
        "one": offload.ActivationOffloader(layers, offload_layers=1),
        "nocopy": offload.ActivationOffloader(layers, offload_layers=1, tensor_filter=_keep_all),
        "big": offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=32 << 20),
    }
    marks = Marks(layers, cuda)
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing offloaded (nocopy) is the point
            for _ in range(3):
                for name in CONFIGS:
                    step(model, ids, offs[name], marks)
            restore = time_methods(TIMED, calls)
            runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
            try:
                for b in range(args.blocks):
                    for name in CONFIGS if b % 2 == 0 else CONFIGS[::-1]:
                        runs[name].append(step(model, ids, offs[name], marks))
            finally:
                restore()
            sent = {n: o.stats.bytes_offloaded for n, o in offs.items() if o is not None}
            sync = None
            if cuda:
                torch.cuda.set_sync_debug_mode(1)
                try:
                    with warnings.catch_warnings(record=True) as w:
                        warnings.simplefilter("always")
                        step(model, ids, None, marks)
                        n_none = len(w)
                        step(model, ids, offs["one"], marks)
                        sync = {"none": n_none, "one": len(w) - n_none}
                finally:
                    torch.cuda.set_sync_debug_mode(0)
    finally:
        marks.remove()
        for o in offs.values():
            if o is not None:
                o.close()
    steps = 3 * args.blocks  # offloading steps timed (three configurations)
    medians = {
        name: {
            k: [statistics.median(r[k][0] for r in rs), statistics.median(r[k][1] for r in rs)]
            for k in rs[0]
        }
        for name, rs in runs.items()
    }
    return {
        "seq": seq,
        "marks": medians,
        "bytes_offloaded": sent,
        "calls_per_step": {k: [n / steps, s * 1e3 / steps] for k, (n, s) in calls.items()},
        "sync_calls": sync,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096", help="comma-separated token counts")
    p.add_argument("--blocks", type=int, default=6, help="rounds of one step of each")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 4-layer model of hidden 64 (smoke)")
    p.add_argument("--out", default=None, help="JSON output file")
    args = p.parse_args(argv)
    try:
        args.lengths = [int(s) for s in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths: comma-separated integers, got {args.lengths!r}")
    if min(args.lengths) < 1 or args.blocks < 1:
        p.error("--lengths and --blocks >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model = llama_1b(max(args.lengths), args.device, args.tiny)
    layers = offload.find_layers(model)
    rows = [measure(model, layers, seq, args) for seq in args.lengths]
    for r in rows:
        print(f"seq {r['seq']}  (host ms, device ms from the step's start)")
        print(" mark    " + "  ".join(f"{n:>15s}" for n in CONFIGS))
        for k in r["marks"]["none"]:
            cells = "  ".join(
                f"{r['marks'][n][k][0]:7.2f} {r['marks'][n][k][1]:7.2f}" for n in CONFIGS
            )
            print(f" {k:8s}{cells}")
        for k, (n, ms) in sorted(r["calls_per_step"].items(), key=lambda x: -x[1][1]):
            print(f"   {k:40s} {n:6.1f} calls {ms:7.3f} ms/step")
        print(f"   MiB sent {dict((k, v / 2**20) for k, v in r['bytes_offloaded'].items())}")
        print(f"   synchronising calls {r['sync_calls']}")
    return results("layer_marks", args, rows)


if __name__ == "__main__":
    main()
