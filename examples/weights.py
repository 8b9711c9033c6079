"""Train a model whose weights, gradients and Adam states do not fit the GPU: the decoder
layers live in host memory (``offload.WeightOffloader(grads="host")``), their gradients
are accumulated on the host and a CPU AdamW updates them.

Run:
    PYTHONPATH=. python3 examples/weights.py                   # GPU: 16 x 2048 layers, 8 GiB budget
    PYTHONPATH=. python3 examples/weights.py --budget-gib 12 --layers 32
    PYTHONPATH=. python3 examples/weights.py --device cpu      # tiny sizes, a few seconds

What it does: a Llama-style model (embedding, ``--layers`` blocks of width ``--dim``,
final norm, head; bf16 on the GPU) learns one synthetic batch by heart (sequences that
count up by one from a random token, modulo the vocabulary). On CUDA the process may use only
``--budget-gib`` of GPU memory (``torch.cuda.set_per_process_memory_fraction``), less
than what mixed-precision training of the blocks needs (bf16 weights and gradients, fp32
master weights and two fp32 Adam moments: 16 bytes per parameter). The blocks' weights
therefore stay in pinned host memory and visit the GPU one layer at a time (the next one
is copied while the current one computes); after each block's backward its gradients go
to an fp32 ``main_grad`` on the host; ``torch.optim.AdamW`` steps on the host masters
(``offloader.host_parameters()``) and ``offloader.push()`` hands the new weights to the
next refills. The embedding, final norm and head stay on the GPU with a GPU AdamW.

What it prints: the memory arithmetic (what plain training would need against the
budget), one line per step with the loss (it goes down), the step time and, on CUDA, the
peak GPU memory of the step; then the offloader's figures (bytes offloaded, pinned host
memory, most layers on the GPU at once).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.models import ReferenceBlock
from offload.profiling import format_bytes

GIB = 2**30


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(ReferenceBlock(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batch_of(vocab: int, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Sequences that count up from a random start modulo ``vocab``: learnable."""
    start = torch.randint(0, vocab, (batch, 1))
    return ((start + torch.arange(seq + 1)) % vocab).to(device)


def adamw(params: list[torch.Tensor], lr: float, on_cpu: bool) -> torch.optim.Optimizer:
    if on_cpu:
        try:  # the fused CPU kernel, where this torch has it
            return torch.optim.AdamW(params, lr=lr, fused=True)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, lr=lr)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=None, help="default 16 (GPU), 4 (CPU)")
    parser.add_argument("--dim", type=int, default=None, help="default 2048 (GPU), 64 (CPU)")
    parser.add_argument("--seq", type=int, default=None, help="default 1024 (GPU), 32 (CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=8.0, help="GPU memory allowed")
    parser.add_argument("--lr", type=float, default=None, help="default 1e-3 (GPU), 5e-3 (CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    layers = args.layers or (16 if gpu else 4)
    dim = args.dim or (2048 if gpu else 64)
    seq = args.seq or (1024 if gpu else 32)
    heads = max(1, dim // 128) if gpu else 4
    ffn = (dim * 11 // 4 + 63) // 64 * 64
    vocab = 32000 if gpu else 256
    lr = args.lr or (1e-3 if gpu else 5e-3)
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * GIB / total), index)
    else:
        torch.set_num_threads(min(4, torch.get_num_threads()))

    torch.manual_seed(0)
    model = Model(vocab, dim, heads, ffn, layers).to(device, dtype)
    block_params = sum(p.numel() for p in model.layers.parameters())
    need = 16 * block_params
    print(
        f"{layers} blocks, {block_params / 1e6:.1f} M parameters: mixed-precision training "
        f"needs {format_bytes(need)} for their weights, gradients and Adam states (16 B per "
        f"parameter); GPU budget "
        + (f"{args.budget_gib:.1f} GiB" if gpu else "not enforced on the CPU")
    )
    if gpu and need <= args.budget_gib * GIB:
        print("  (that fits the budget: pass a smaller --budget-gib or more --layers)")

    offloader = offload.WeightOffloader(model.layers, grads="host")
    host_opt = adamw(offloader.host_parameters(), lr, on_cpu=True)
    rest = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    device_opt = adamw(rest, lr, on_cpu=not gpu)

    tokens = batch_of(vocab, args.batch, seq, device)  # one batch, learnt by heart
    for step in range(args.steps):
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()  # returns once every block's main_grad is complete on the host
        device_opt.step()
        host_opt.step()
        device_opt.zero_grad(set_to_none=True)
        host_opt.zero_grad(set_to_none=True)
        offloader.push()  # the updated masters become the weights of the next refills
        line = f"step {step}: loss {loss.item():.4f} ({(time.perf_counter() - t0) * 1e3:.0f} ms"
        if gpu:
            line += f", peak GPU memory {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB"
        print(line + ")")

    print(
        f"offloaded {format_bytes(offloader.bytes_offloaded)} of block weights; pinned host "
        f"memory {format_bytes(offloader.pinned_bytes)}; host memory in all "
        f"{format_bytes(offloader.host_bytes)} (with fp32 masters and main_grad); at most "
        f"{offloader.max_resident_layers} of {layers} blocks on the device at once"
    )
    offloader.close()


if __name__ == "__main__":
    main()
