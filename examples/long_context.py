"""Train a Hugging Face Llama on a long sequence with the long-context levers.

The model is built from a random config (nothing is downloaded). The script runs a few
forward + backward steps twice from the same weights on the same batch: once plain
(Hugging Face checkpointing off, the full logits), once with the three levers of
docs/long-context.md: ``offload_checkpointing(model)`` (each decoder layer's input in
host memory, the layer recomputed in the backward), ``offload.sliced_head_loss(model)``
(the LM head and cross-entropy a slice of the sequence at a time, no full logits) and
``offload.tile_mlp(model)`` (each MLP recomputed a tile of the sequence at a time).

Run:
    python examples/long_context.py                                # tiny model, CPU or GPU, seconds
    python examples/long_context.py --size 1b --seq 16384 --device cuda   # ~1.1B, bf16

Prints, per run and step, the loss; then the largest loss difference between the runs,
the largest gradient difference relative to the largest gradient of the plain run
(``gradients within tolerance: True`` when it is at most 1e-5 in fp32 or 2e-2 in bf16),
and on CUDA each run's activation peak (``max_memory_allocated`` during a step minus
what was allocated before it). ``--skip-plain`` leaves the plain run out (a sequence it
cannot fit).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import offload
from offload.integrations.hf import offload_checkpointing

SIZES = {
    # seconds on a CPU
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),  # fmt: skip
    # the "HF Llama ~1.1B" of the benchmarks
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        vocab_size=32000,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),  # fmt: skip
}


def build(size: str, seq: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        **SIZES[size],
        max_position_embeddings=max(seq, 2048),
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


def run(model, ids, labels, steps, device, name):
    """``steps`` forward + backward steps; returns the losses, the last step's
    gradients and the activation peak (CUDA) of the last step."""
    losses, peak = [], None
    for i in range(steps):
        model.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        ms = (time.perf_counter() - start) * 1e3
        losses.append(loss.item())
        print(f"[{name}] step {i}: loss {loss.item():.6f} ({ms:.0f} ms)", flush=True)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq", type=int, default=None, help="tokens (default: 256 tiny, 16384 1b)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--slice-tokens", default="auto", help="sliced_head_loss's slice_tokens")
    p.add_argument("--tile-tokens", default="auto", help="tile_mlp's tile_tokens")
    p.add_argument("--skip-plain", action="store_true")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be at least 1; got {args.steps}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq = args.seq or (256 if args.size == "tiny" else 16384)
    slice_tokens = args.slice_tokens if args.slice_tokens == "auto" else int(args.slice_tokens)
    tile_tokens = args.tile_tokens if args.tile_tokens == "auto" else int(args.tile_tokens)
    if args.size == "tiny" and tile_tokens == "auto":
        tile_tokens = 64  # "auto" tiles are >= 1024 tokens: more than the tiny run has

    model = build(args.size, seq, device, dtype)
    levers = copy.deepcopy(model) if not args.skip_plain else model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=g).to(device)
    labels = ids.clone()
    labels[:, : seq // 8] = -100  # a prompt that does not count in the loss

    if not args.skip_plain:
        plain_losses, plain_grads, plain_peak = run(model, ids, labels, args.steps, device, "plain")
        del model

    ckpt = offload_checkpointing(levers)
    head = offload.sliced_head_loss(levers, slice_tokens=slice_tokens)
    tiles = offload.tile_mlp(levers, tile_tokens=tile_tokens)
    losses, grads, peak = run(levers, ids, labels, args.steps, device, "levers")
    print(f"head calls in slices: {head.calls}, tiled MLP calls: {tiles.calls}")

    if not args.skip_plain:
        loss_diff = max(abs(a - b) for a, b in zip(losses, plain_losses))
        rel = max(
            ((grads[n].float() - g.float()).abs().max() / g.float().abs().max()).item()
            for n, g in plain_grads.items()
        )
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        print(f"max |loss difference| between the runs: {loss_diff:.3g}")
        print(f"largest gradient difference / largest gradient: {rel:.3g}")
        print(f"gradients within tolerance: {rel <= tol}")
        if plain_peak is not None:
            print(f"activation peak: plain {plain_peak / 2**30:.2f} GiB, ", end="")
    if peak is not None:
        print(f"with the levers {peak / 2**30:.2f} GiB")
    tiles.remove()
    head.remove()
    ckpt.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
