"""Layers compiled one by one under offloading: graph breaks, graphs per layer call, and
bitwise equality against the same compiled layers without offloading.

Commands (CPU with ``aot_eager``: a few minutes; GPU with inductor)::

    PYTHONPATH=. python3 benchmarks/activations/bench_compile.py --out benchmarks/results/compile_cpu.json
    PYTHONPATH=. python3 benchmarks/activations/bench_compile.py --device cuda --backend inductor \\
        --out $OUT/bench_compile_cuda.json

A stack of ``--layers`` (4) ``tests.models.LlamaBlock`` layers (``--dim`` 64, 4 heads,
FFN ``2 * dim``; input ``2 x --seq`` (16) tokens) is compiled layer by layer in one of
three forms:

* ``layer.compile()``: ``nn.Module._call_impl`` compiled in place, module hooks
  included (torchtune's ``compile_model``, many Hugging Face recipes);
* ``torch.compile(layer)``: an ``OptimizedModule`` wrapper, the offloader given the
  wrappers (their hooks run outside the compiled code);
* ``torch.compile(layer), inner``: the same wrappers, the offloader given the original
  layers (their hooks run inside the compiled code).

and run in one of four modes: ``none`` (no offloading), ``activations``
(``ActivationOffloader(offload_layers="all", min_tensor_bytes=0)``), ``checkpoint``
(``CheckpointOffloader(min_tensor_bytes=0).checkpoint(layer, h)`` around each compiled
layer) and ``checkpoint inside`` (each layer's forward calls the checkpoint on its own
body, as Hugging Face's ``GradientCheckpointingLayer`` does, so it is traced with the
layer).

Columns, for ``--steps`` (3) forward + backward steps after a ``torch._dynamo.reset()``:

* ``breaks``: the sum of ``torch._dynamo.utils.counters["graph_break"]`` over all steps.
  Identical layers share one compiled frame (dynamo compiles the first layer's call and
  reuses it for the others), so this is the count for one layer; ``--layers 1`` gives
  the same numbers;
* ``breaks after warm-up``: the same counter, cleared after the first step (graph breaks
  met again, i.e. recompilations);
* ``graphs/call``: calls of compiled forward graphs (counted by a wrapper around the
  backend) per layer call in the last step: the forward, and with ``offload.checkpoint``
  the recomputation;
* ``frames``: ``counters["stats"]["unique_graphs"]``, graphs compiled;
* ``bitwise``: loss, every parameter gradient and the input gradient ``torch.equal`` to
  the same compiled layers run without offloading, at every step (``None`` for
  ``checkpoint inside``: the layers call the checkpoint themselves, there is no run
  without it);
* ``offloaded``: bytes the offloader (or the checkpoint offloader) sent to the host in
  the last step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import offload  # noqa: E402
from benchmarks import _common  # noqa: E402
from tests import models  # noqa: E402

FORMS = {
    "method": "layer.compile()",
    "wrapper": "torch.compile(layer)",
    "inner": "torch.compile(layer), inner",
}
MODES = ["none", "activations", "checkpoint", "checkpoint inside"]


class _SelfCheckpointing(nn.Module):
    def __init__(self, block: nn.Module, ckpt: offload.CheckpointOffloader) -> None:
        super().__init__()
        self.block, self.ckpt = block, ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ckpt.checkpoint(self.block, x)


def measure(form: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.backends.registry import lookup_backend

    import offload._recompute._checkpoint as ck

    runs = [0]
    inner_backend = lookup_backend(args.backend)

    def counting(gm: Any, example_inputs: Any) -> Any:
        compiled = inner_backend(gm, example_inputs)

        def call(*a: Any) -> Any:
            runs[0] += 1
            return compiled(*a)

        return call

    torch._dynamo.reset()
    ck._traced_warned = False
    torch.manual_seed(0)
    dev = torch.device(args.device)
    ckpt = offload.CheckpointOffloader(min_tensor_bytes=0)
    blocks: list[nn.Module] = [
        models.LlamaBlock(args.dim, 4, 2 * args.dim).to(dev) for _ in range(args.layers)
    ]
    if mode == "checkpoint inside":
        blocks = [_SelfCheckpointing(b, ckpt) for b in blocks]
    if form == "method":
        for b in blocks:
            b.compile(backend=counting)
        stack, hooked = nn.ModuleList(blocks), blocks
    else:
        stack = nn.ModuleList(torch.compile(b, backend=counting) for b in blocks)
        hooked = blocks if form == "inner" else list(stack)
    off = (
        offload.ActivationOffloader(hooked, offload_layers="all", min_tensor_bytes=0)
        if mode == "activations"
        else None
    )

    def runner(layers: Any, h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = ckpt.checkpoint(layer, h) if mode == "checkpoint" else layer(h)
        return h

    counters.clear()
    bitwise: bool | None = True
    after_warmup, per_call, offloaded = 0, 0.0, 0
    for i in range(args.steps):
        x = torch.randn(2, args.seq, args.dim, device=dev) + i
        if i == 1:
            after_warmup = -sum(counters["graph_break"].values())
        ckpt.reset_stats()
        runs[0] = 0
        got = models.step(stack, x, runner, off)
        per_call = runs[0] / args.layers
        offloaded = off.stats.bytes_offloaded if off is not None else ckpt.stats.bytes_offloaded
        if mode == "checkpoint inside":  # its own reference: nothing to compare with
            bitwise = None
            continue
        want = models.step(stack, x, models.run_plain)
        try:
            models.assert_same(got, want)
        except AssertionError:
            bitwise = False
    breaks = sum(counters["graph_break"].values())
    reasons = sorted({r.splitlines()[0][:120] for r in counters["graph_break"]})
    if off is not None:
        off.close()
    ckpt.close()
    return {
        "form": FORMS[form],
        "mode": mode,
        "breaks": breaks,
        "breaks_after_warmup": breaks + after_warmup,
        "graphs_per_layer_call": per_call,
        "frames": counters["stats"]["unique_graphs"],
        "bitwise": bitwise,
        "offloaded_bytes": offloaded,
        "break_reasons": reasons,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.device == "cuda":
        torch.use_deterministic_algorithms(True)
    rows = []
    for form in FORMS:
        for mode in MODES:
            try:
                rows.append(measure(form, mode, args))
            except Exception as e:  # recorded, and the other rows still run
                rows.append({"form": FORMS[form], "mode": mode, "error": repr(e)[:2000]})
    header = f"{'form':30s} {'mode':18s} breaks  after  graphs/call  frames  bitwise  offloaded"
    print(f"backend {args.backend}, device {args.device}, torch {torch.__version__}")
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['form']:30s} {r['mode']:18s} FAILED {r['error'][:200]}")
            continue
        print(
            f"{r['form']:30s} {r['mode']:18s} {r['breaks']:6d} {r['breaks_after_warmup']:6d} "
            f"{r['graphs_per_layer_call']:12.1f} {r['frames']:7d}  {str(r['bitwise']):7s} "
            f"{r['offloaded_bytes']:10d}"
        )
    if args.out:
        _common.write_json(
            args.out,
            {
                "settings": vars(args),
                "environment": _common.environment(torch.device(args.device)),
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
