"""A small MoE model trained with fused weight-gradient accumulation and activation offloading.

Run (CPU, a few seconds; uses a GPU when there is one):

    PYTHONPATH=. python3 examples/moe.py

What it does: four MoE blocks (LayerNorm, router, top-2 routing, permute, SwiGLU experts
as two ``offload.nn.GroupedLinear`` with ``fuse_wgrad_accumulation=True``, unpermute
with the gate weights, residual) and an ``offload.nn.Linear`` head are trained for 4
steps of 2 micro-batches on a synthetic regression task. Expert and head weights write
their gradients straight into fp32 ``main_grad`` buffers (``offload.main_grad.attach``);
the router, norms and biases get ``.grad`` as usual; ``offload.main_grad.to_grads`` hands
both to the optimizer. Each forward runs under ``offload.ActivationOffloader`` over the
four blocks, so their saved activations go to host memory (all but the last block) and
come back during backward.

What it prints: one line per step with the loss (it goes down), the tokens per expert
of the first block, and the bytes offloaded by the last forward; then the per-layer
offload statistics of the last step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import offload

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K, LAYERS = 256, 64, 256, 4, 2, 4
STEPS, MICRO_BATCHES = 4, 2


class MoEBlock(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN, device=device)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False, device=device)
        # SwiGLU experts: fc1 produces gate and up projections side by side
        self.fc1 = offload.nn.GroupedLinear(
            EXPERTS, HIDDEN, 2 * FFN, device=device, fuse_wgrad_accumulation=True
        )
        self.fc2 = offload.nn.GroupedLinear(
            EXPERTS, FFN, HIDDEN, device=device, fuse_wgrad_accumulation=True
        )
        self.last_counts: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        probs = torch.softmax(self.router(h), dim=-1)
        gates, experts = probs.topk(TOP_K, dim=-1)  # [tokens, k]
        gates = gates / gates.sum(dim=-1, keepdim=True)
        # permute: one row per (token, chosen expert), grouped by expert
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of_row = order // TOP_K
        # rows per expert must be known on the host (GroupedLinear rejects a device
        # tensor); on a GPU this .tolist() is the one sync per layer that MoE needs
        counts = torch.bincount(flat_experts, minlength=EXPERTS).tolist()
        self.last_counts = counts
        gate_up = self.fc1(h[token_of_row], counts)
        gate, up = gate_up.chunk(2, dim=-1)
        y = self.fc2(F.silu(gate) * up, counts)
        # unpermute: weight each expert output by its gate and add it to its token
        y = y * gates.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add(0, token_of_row, y)
        return x + out


class Model(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(device) for _ in range(LAYERS))
        self.head = offload.nn.Linear(HIDDEN, HIDDEN, device=device, fuse_wgrad_accumulation=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Model(device)
    offload.main_grad.attach(model)  # fp32 buffers for every trainable parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    off = offload.ActivationOffloader(model.layers)
    teacher = torch.randn(HIDDEN, HIDDEN, device=device) / HIDDEN**0.5

    data = torch.Generator(device=device).manual_seed(1)
    for step in range(STEPS):
        total = 0.0
        for _ in range(MICRO_BATCHES):
            x = torch.randn(TOKENS, HIDDEN, device=device, generator=data)
            with off:
                loss = F.mse_loss(model(x), torch.tanh(x @ teacher)) / MICRO_BATCHES
            loss.backward()  # fused layers: main_grad += dW; others: .grad
            total += loss.item()
        offload.main_grad.to_grads(model)  # main_grad (+ .grad) -> .grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        offload.main_grad.zero_(model)
        print(
            f"step {step}: loss {total:.4f}  tokens per expert (layer 0) "
            f"{model.layers[0].last_counts}  offloaded {off.stats.bytes_offloaded / 2**20:.2f} MiB"
        )

    stats = off.stats
    print(f"last forward: {stats.bytes_offloaded / 2**20:.2f} MiB offloaded in total")
    for layer in stats.layers:
        print(
            f"  layer {layer.index}: offloaded={layer.offloaded} "
            f"{layer.bytes_offloaded / 2**20:.2f} MiB"
        )
    off.close()


if __name__ == "__main__":
    main()
