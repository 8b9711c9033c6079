"""Offloaded checkpointing on a Hugging Face Llama: plain gradient checkpointing vs
``offload.integrations.hf.offload_checkpointing``, in one process.

Command (one CUDA GPU; about two minutes on an H200)::

    PYTHONPATH=. python3 benchmarks/checkpoint/bench_checkpoint_hf.py --out benchmarks/results/checkpoint_hf.json
    PYTHONPATH=. python3 benchmarks/checkpoint/bench_checkpoint_hf.py --quick --device cpu --out /tmp/h.json

Model: ``LlamaForCausalLM`` from a config with random weights (hidden 2048, 16 layers,
32 heads, 4 KV heads, ffn 5632, vocab 32000, SDPA, bf16; ~1.1B parameters), batch 1,
``--seqs`` (8192, 16384, 32768); loss = the model's causal LM loss on random tokens.
Rows per sequence length: ``checkpoint`` (``model.gradient_checkpointing_enable(
gradient_checkpointing_kwargs={"use_reentrant": False})``) and ``offload.checkpoint``
(``offload_checkpointing(model)``; its handle is removed after the row).

Columns: ``step ms``: median of ``--steps`` forward + backward steps after ``--warmup``
(CUDA events); ``x ckpt``: ratio to the ``checkpoint`` row of the same length; ``peak
GiB``: ``max_memory_allocated`` during a step (gradients zeroed between steps, not
freed); ``inputs``: the decoder layers' input bytes L x seq x hidden x 2; ``drop``:
peak of ``checkpoint`` minus peak of ``offload.checkpoint``; ``D2H``: bytes the
offloaded checkpointing sent (``checkpoint_stats``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import offload  # noqa: E402
from benchmarks._common import llama_1b_config  # noqa: E402
from offload.integrations.hf import offload_checkpointing  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seqs", default="8192,16384,32768")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.quick:
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
        seqs = [64, 128]
    else:
        cfg = llama_1b_config(65536)
        seqs = [int(s) for s in args.seqs.split(",")]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=dtype)
    model.train()
    rows: list[dict[str, Any]] = []
    for seq in seqs:
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)
        for mode in ("checkpoint", "offload.checkpoint"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            handle = offload_checkpointing(model) if mode == "offload.checkpoint" else None
            offload.checkpoint_stats(reset=True)
            times, peaks = [], []
            for i in range(args.warmup + args.steps):
                for prm in model.parameters():
                    if prm.grad is not None:
                        prm.grad.zero_()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                if cuda:
                    end.record()
                    end.synchronize()
                    if i >= args.warmup:
                        times.append(start.elapsed_time(end))
                        peaks.append(torch.cuda.max_memory_allocated())
                del loss
            stats = offload.checkpoint_stats()
            if handle is not None:
                handle.remove()
            rows.append(
                {
                    "seq": seq,
                    "mode": mode,
                    "step_ms_median": statistics.median(times) if times else None,
                    "peak_bytes": max(peaks) if peaks else None,
                    "inputs_bytes": cfg.num_hidden_layers
                    * seq
                    * cfg.hidden_size
                    * (2 if cuda else 4),
                    "bytes_offloaded_per_step": stats.bytes_offloaded / (args.warmup + args.steps),
                }
            )
        if cuda:
            torch.cuda.empty_cache()
    print(
        f"{'seq':>6} {'mode':<20} {'step ms':>9} {'x ckpt':>7} {'peak GiB':>9} "
        f"{'inputs GiB':>10} {'drop GiB':>9} {'D2H GiB':>8}"
    )
    for r in rows:
        ref = next(x for x in rows if x["seq"] == r["seq"] and x["mode"] == "checkpoint")
        ratio = drop = None
        if r["step_ms_median"] and ref["step_ms_median"]:
            ratio = r["step_ms_median"] / ref["step_ms_median"]
            drop = (ref["peak_bytes"] - r["peak_bytes"]) / 2**30
        r["x_ckpt"], r["drop_gib"] = ratio, drop
        fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
        print(
            f"{r['seq']:>6} {r['mode']:<20} {fmt(r['step_ms_median'], '9.1f'):>9} "
            f"{fmt(ratio, '.3f'):>7} {fmt(r['peak_bytes'] and r['peak_bytes'] / 2**30, '.2f'):>9} "
            f"{r['inputs_bytes'] / 2**30:>10.2f} {fmt(drop, '.2f'):>9} "
            f"{r['bytes_offloaded_per_step'] / 2**30:>8.2f}"
        )
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev) if cuda else "cpu"}
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
