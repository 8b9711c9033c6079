"""Quickstart: train a small Llama-style model with activation offloading.

Run:
    python examples/quickstart.py            # CPU: a few seconds; uses the GPU when present
    python examples/quickstart.py --steps 5 --layers 6

Prints the loss of each step, then the offloader's report of the last step: which layers
sent how many bytes to host memory and why the rest stayed on the device. On a GPU it also
prints the peak memory of one step with and without offloading.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import offload


class Block(nn.Module):
    """RMSNorm, causal self-attention, RMSNorm, SwiGLU MLP, with residuals."""

    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = 1000
    model = TinyLlama(vocab, args.dim, 4, 4 * args.dim, args.layers).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Every layer but the last; tensors under 64 KiB stay. The default, "auto", offloads
    # what the host link hides behind compute (on a CPU, which has nothing to hide
    # copies behind, it selects like "all").
    offloader = offload.ActivationOffloader(
        model.layers, offload_layers="all", min_tensor_bytes=64 * 1024
    )

    def train_step(use_offload: bool) -> float:
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), device=device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if use_offload:
            with offloader:  # the forward only; backward runs outside
                logits = model(inputs)
        else:
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(True)
        print(f"step {step}: loss {loss:.4f} ({(time.perf_counter() - t0) * 1e3:.0f} ms)")

    offloader.report()
    if device.type == "cuda":
        for use in (False, True):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            train_step(use)
            peak = torch.cuda.max_memory_allocated() / 2**20
            print(f"peak memory {'with' if use else 'without'} offloading: {peak:.1f} MiB")
    offloader.close()


if __name__ == "__main__":
    main()
