"""Train a Hugging Face Llama with activation offloading found by ``offload.find_layers``.

The model is built from a random config (nothing is downloaded). The script trains it
for a few AdamW steps twice, from the same initial weights and on the same batches:
once without offloading (the baseline) and once with ``offload.ActivationOffloader``
over the decoder layers that ``offload.find_layers(model)`` returns.

Run:
    python examples/hf_llama.py                          # tiny model, CPU or GPU, seconds
    python examples/hf_llama.py --size 1b --device cuda  # ~1.1B params, seq 4096, bf16
    python examples/hf_llama.py --size 1b --steps 6 --deterministic --out llama1b.json

Prints, per run and step, the loss and the step time; for the offloaded run the bytes
sent to the host (``stats.bytes_offloaded``) and the per-layer split; then a summary:
the median step time of each run (the first step, a warm-up, excluded) and their
ratio, the largest loss difference between the runs (0 on CPU; on a GPU only with
``--deterministic``, as bf16 attention backward kernels are not deterministic), and on
CUDA the peak allocated memory of each run
(``torch.cuda.max_memory_allocated``, reset between runs) with the saving
``peak without - peak with`` beside ``stats.bytes_released`` (the device memory the
offloader's releases freed; ``bytes_offloaded`` also counts storages that something else
kept alive) and their ratio. Gradients are zeroed, not freed, between steps, so the
peak of both runs is at the start of backward, where every offloaded group is off the
device: the ratio should be close to 1. ``--out`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

import offload
from offload.profiling import format_bytes

SIZES: dict[str, dict[str, Any]] = {
    # seconds on a CPU
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        seq=64,
        batch=2,
        min_tensor_bytes=0,  # its tensors are all below the 256 KiB default
    ),
    # ~1.1B parameters (0.97B in the 16 layers, 2 x 65.5M in embedding and LM head)
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        seq=4096,
        batch=1,
        min_tensor_bytes=256 * 1024,  # the library default
    ),
}


_RUN_KEYS = ("seq", "batch", "min_tensor_bytes")  # not LlamaConfig fields


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: per size)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: per size)")
    p.add_argument(
        "--min-tensor-bytes",
        type=int,
        default=None,
        help="ActivationOffloader(min_tensor_bytes=...) (default: 0 for tiny, 256 KiB for 1b)",
    )
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: cuda if available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="parameter dtype; auto = bfloat16 on CUDA, float32 elsewhere",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the run without offloading")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True): on a GPU the two runs' losses are "
        "then bitwise equal (some bf16 kernels, e.g. attention backward, are not otherwise)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1; got {args.steps}")
    for name in ("seq", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1; got {value}")
    if args.min_tensor_bytes is not None and args.min_tensor_bytes < 0:
        p.error(f"--min-tensor-bytes must be >= 0; got {args.min_tensor_bytes}")
    return args


def build_model(size: str, seq: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A Llama of ``SIZES[size]`` with random weights (no download), in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: v for k, v in SIZES[size].items() if k not in _RUN_KEYS}
    config = LlamaConfig(
        **shape,
        max_position_embeddings=max(4096, seq),
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: argparse.Namespace, use_offload: bool) -> dict[str, Any]:
    """One run of ``args.steps`` AdamW steps; returns losses, times, peak and stats."""
    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    seq = args.seq or SIZES[args.size]["seq"]
    batch = args.batch or SIZES[args.size]["batch"]
    vocab = SIZES[args.size]["vocab_size"]

    torch.manual_seed(0)  # same weights and batches in both runs
    model = build_model(args.size, seq, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    layers = offload.find_layers(model)
    min_bytes = args.min_tensor_bytes
    if min_bytes is None:
        min_bytes = SIZES[args.size]["min_tensor_bytes"]
    offloader = (
        offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=min_bytes)
        if use_offload
        else None
    )
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(args.steps)]

    name = "offload" if use_offload else "baseline"
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for step, ids in enumerate(batches):
        ids = ids.to(device)
        _sync(device)
        start = time.perf_counter()
        if offloader is not None:
            with offloader:
                loss = model(ids, labels=ids).loss
        else:
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        # Keep the gradient buffers between steps (allocated once): backward then adds no
        # memory of its own, and the peak of a step is at the start of backward in both
        # runs, where every offloaded group is off the device.
        opt.zero_grad(set_to_none=False)
        _sync(device)
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        times.append(elapsed)
        print(f"[{name}] step {step}: loss {losses[-1]:.4f}  time {elapsed * 1e3:.1f} ms")

    result: dict[str, Any] = {
        "losses": losses,
        "step_seconds": times,
        "median_step_seconds": statistics.median(times[1:] or times),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    if offloader is not None:
        stats = offloader.stats
        result["bytes_offloaded"] = stats.bytes_offloaded
        result["bytes_released"] = stats.bytes_released
        result["stats"] = stats.to_dict()
        print(f"[{name}] {stats.summary()}")
        per_layer = ", ".join(
            f"{la.index}:{format_bytes(la.bytes_offloaded)}" for la in stats.layers
        )
        print(f"[{name}] bytes offloaded per layer: {per_layer}")
        offloader.close()
    result["params"] = sum(p.numel() for p in model.parameters())
    result["num_layers"] = len(layers)
    del model, opt, offloader
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda was asked for but CUDA is not available", file=sys.stderr)
        return 2
    fmt = format_bytes
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True)

    runs: dict[str, Any] = {}
    if not args.no_baseline:
        runs["baseline"] = train(args, use_offload=False)
    runs["offload"] = train(args, use_offload=True)
    off = runs["offload"]
    print(
        f"model: Llama {args.size}, {off['params'] / 1e6:.1f}M parameters, "
        f"{off['num_layers']} layers (find_layers), device {device}"
    )
    print(f"bytes offloaded per step: {off['bytes_offloaded']} ({fmt(off['bytes_offloaded'])})")
    summary: dict[str, Any] = {"bytes_offloaded": off["bytes_offloaded"]}
    if "baseline" in runs:
        base = runs["baseline"]
        ratio = off["median_step_seconds"] / base["median_step_seconds"]
        print(
            f"median step time: without {base['median_step_seconds'] * 1e3:.1f} ms, with "
            f"{off['median_step_seconds'] * 1e3:.1f} ms (x{ratio:.3f})"
        )
        diff = max(abs(a - b) for a, b in zip(base["losses"], off["losses"], strict=True))
        print(f"max |loss difference| between the runs: {diff:.3g}")
        summary.update(step_time_ratio=ratio, max_loss_difference=diff)
        if base["peak_bytes"] is not None:
            saving = base["peak_bytes"] - off["peak_bytes"]
            freed = off["bytes_released"]
            share = saving / freed if freed else float("nan")
            print(
                f"peak memory: without {fmt(base['peak_bytes'])}, with "
                f"{fmt(off['peak_bytes'])}; saving {fmt(saving)} vs stats.bytes_released "
                f"{fmt(freed)} (ratio {share:.3f}; bytes_offloaded "
                f"{fmt(off['bytes_offloaded'])})"
            )
            summary.update(
                peak_saving_bytes=saving, bytes_released=freed, saving_over_released=share
            )

    if args.out:
        record = {"args": vars(args), "summary": summary, "runs": runs}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
