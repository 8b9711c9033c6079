"""``offload_layers="auto"`` against every fixed k and no offloading, in one process.

Command (one CUDA GPU; about three minutes on an H200)::

    PYTHONPATH=. python3 benchmarks/activations/bench_auto.py --out benchmarks/results/auto.json
    PYTHONPATH=. python3 benchmarks/activations/bench_auto.py --quick --device cpu --out /tmp/a.json

Models (bf16, forward + backward, no optimizer step):

* ``ref-8L``: 8 Llama-style layers (``offload._reference``), hidden 4096, 32 heads, ffn
  14336, seq 4096, batch 1; loss = mean of squares of the output.
* ``hf-llama-1b seq N``: a Hugging Face Llama built from a config with random weights
  (hidden 2048, 16 layers, 32 heads, 4 KV heads, ffn 5632, vocab 32000, SDPA), batch 1,
  seq 4096 and 16384; loss = the model's causal LM loss; layers = ``find_layers(model)``.

Rows per model: ``none`` (no offloader), ``k=n`` (``offload_layers=n``) for the ``--ks``,
and ``auto`` (``offload_layers="auto"``, the default: its first step measures, so it
gets one more warm-up step than the others, which is still warm-up).

Columns: ``step ms``: median of ``--steps`` timed steps after ``--warmup`` (CUDA events
around forward + backward); ``x none``: ratio to the ``none`` row of the same model;
``act GiB``: peak allocated during a step minus allocated before it (gradients exist
and are zeroed, not freed, so the backward allocates none of them); ``saved GiB``: the
``none`` row's act GiB minus this row's; ``k``: layers offloaded (for ``auto``: what it
chose, and its reason from ``stats.auto``). Targets (issue 16): ``auto`` at most 1.03x
of ``none`` on every model and saving at least 90% of the memory of the best fixed k
that stays within 1.03x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import offload  # noqa: E402
from offload._reference import ReferenceModel  # noqa: E402


def ref_model(args, device, dtype):
    if args.quick:
        model = ReferenceModel(4, 64, 4, 128, device=device, dtype=dtype)
        shape = (1, 32, 64)
    else:
        model = ReferenceModel(8, 4096, 32, 14336, device=device, dtype=dtype)
        shape = (1, 4096, 4096)
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(*shape, device=device, dtype=dtype, generator=gen)
    return (
        "ref-8L" if not args.quick else "ref (quick)",
        model,
        list(model.layers),
        lambda: model.loss(x),
    )


def hf_model(args, device, dtype, seq):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.quick:
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
        seq = 32
    else:
        cfg = LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=max(seq, 4096),
        )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    name = f"hf-llama-1b seq {seq}" if not args.quick else "hf-llama (quick)"
    return name, model, offload.find_layers(model), lambda: model(input_ids=ids, labels=ids).loss


class Timer:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def run_row(model, layers, loss_fn, selection, args, cuda) -> dict[str, Any]:
    off = (
        None
        if selection == "none"
        else offload.ActivationOffloader(layers, offload_layers=selection)
    )
    timer = Timer(cuda)
    times, acts = [], []
    warmup = args.warmup + (1 if selection == "auto" else 0)
    for i in range(warmup + args.steps):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = timer.mark()
        with off if off is not None else contextlib.nullcontext():
            loss = loss_fn()
        loss.backward()
        end = timer.mark()
        ms = timer.ms(start, end)
        del loss
        if i >= warmup:
            times.append(ms)
            if cuda:
                acts.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    row: dict[str, Any] = {
        "selection": selection,
        "step_ms": times,
        "step_ms_median": statistics.median(times),
        "act_gib": max(acts) if acts else None,
    }
    if off is not None:
        stats = off.stats
        row["k"] = sum(1 for la in stats.layers if la.offloaded)
        row["bytes_offloaded"] = stats.bytes_offloaded
        if stats.auto is not None:
            row["auto"] = stats.auto
        off.close()
    else:
        row["k"] = 0
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seqs", default="4096,16384", help="HF Llama sequence lengths")
    p.add_argument("--models", default="ref,hf", help="ref, hf or both")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    builders = []
    if "ref" in args.models:
        builders.append(lambda: ref_model(args, device, dtype))
    if "hf" in args.models:
        for seq in [int(s) for s in args.seqs.split(",")]:
            builders.append(lambda seq=seq: hf_model(args, device, dtype, seq))
    results = []
    for build in builders:
        name, model, layers, loss_fn = build()
        L = len(layers)
        ks = sorted({1, 2, 3, 4, 6, L // 2, L - 1} & set(range(1, L)))
        rows = [run_row(model, layers, loss_fn, "none", args, cuda)]
        for k in ks:
            rows.append(run_row(model, layers, loss_fn, k, args, cuda))
        rows.append(run_row(model, layers, loss_fn, "auto", args, cuda))
        none = rows[0]
        for r in rows:
            r["x_none"] = r["step_ms_median"] / none["step_ms_median"]
            if r["act_gib"] is not None and none["act_gib"] is not None:
                r["saved_gib"] = none["act_gib"] - r["act_gib"]
        fixed_ok = [r for r in rows[1:-1] if r["x_none"] <= 1.03]
        best = max(fixed_ok, key=lambda r: r.get("saved_gib") or 0, default=None)
        auto = rows[-1]
        verdict = {
            "auto_x_none": auto["x_none"],
            "best_fixed_within_1.03": None if best is None else best["selection"],
            "auto_saved_share_of_best": (
                None
                if best is None or not best.get("saved_gib") or auto.get("saved_gib") is None
                else auto["saved_gib"] / best["saved_gib"]
            ),
        }
        results.append({"model": name, "layers": L, "rows": rows, "verdict": verdict})
        print(f"\n{name} ({L} layers)")
        print(f"{'row':>6} {'step ms':>9} {'x none':>7} {'act GiB':>8} {'saved':>7} {'k':>3}")
        for r in rows:
            act = "n/a" if r["act_gib"] is None else f"{r['act_gib']:.2f}"
            saved = "" if r.get("saved_gib") is None else f"{r['saved_gib']:.2f}"
            print(
                f"{str(r['selection']):>6} {r['step_ms_median']:9.1f} {r['x_none']:7.3f} "
                f"{act:>8} {saved:>7} {r['k']:>3}"
            )
        if "auto" in auto:
            print("auto:", auto["auto"].get("reason"))
        print("verdict:", json.dumps(verdict))
        del model, layers, loss_fn
        if cuda:
            torch.cuda.empty_cache()
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(device) if cuda else "cpu"}
    with open(args.out, "w") as f:
        json.dump({"env": env, "results": results}, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
