"""The TransformerEngine-style manual API: ``offload.get_cpu_offload_context``.

Code written for TransformerEngine's ``te.pytorch.get_cpu_offload_context`` runs
unchanged against ``offload``: one ``with ctx:`` entry per layer call, then
``x = sync(x)`` on the layer's output to mark the group boundary for the backward::

    ctx, sync = offload.get_cpu_offload_context(True, num_layers=N, model_layers=L)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync(x)

After ``model_layers`` entries the next entry starts a new step; the first
``num_layers`` layers of each step are offloaded (``num_layers <= model_layers - 1``,
as in TE). The script trains a stack of MLP blocks for a few AdamW steps twice from the
same weights on the same batches, with and without offloading, and checks that the loss
and every gradient are bitwise equal at each step.

Run:
    python examples/te_compat.py                       # CPU or GPU, well under a second
    python examples/te_compat.py --layers 8 --offload-layers 6 --steps 5 --device cuda

Prints per step the loss of both runs and whether all gradients are equal, the bytes
offloaded in the last step, and finally ``grads equal: True`` (exit status 0) or
``grads equal: False`` (exit status 1).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import offload
from offload.profiling import format_bytes


class Block(nn.Module):
    """A pre-norm MLP block with a residual connection."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="model_layers (default 4)")
    p.add_argument(
        "--offload-layers",
        type=int,
        default=None,
        help="num_layers, offloaded per step; <= layers - 1 (default: layers - 1)",
    )
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per batch (default 512)")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: cuda if available, else cpu)",
    )
    args = p.parse_args(argv)
    for name in ("layers", "steps", "dim", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.offload_layers is None:
        args.offload_layers = args.layers - 1
    if not 0 <= args.offload_layers <= args.layers - 1:
        p.error(
            f"--offload-layers must be between 0 and --layers - 1 = {args.layers - 1}; "
            f"got {args.offload_layers}"
        )
    return args


def forward(
    layers: nn.ModuleList,
    x: torch.Tensor,
    ctx: Any = None,
    sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The stack, optionally under the TE-style context (one entry per layer)."""
    for layer in layers:
        if ctx is None:
            x = layer(x)
        else:
            with ctx:
                x = layer(x)
            x = sync(x)  # type: ignore[misc]
    return x


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(args.dim) for _ in range(args.layers)).to(device)
    ref_layers = copy.deepcopy(layers)
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_layers.parameters(), lr=1e-3)

    ctx, sync = offload.get_cpu_offload_context(
        True, num_layers=args.offload_layers, model_layers=args.layers
    )
    print(
        f"get_cpu_offload_context(True, num_layers={args.offload_layers}, "
        f"model_layers={args.layers}) on {device}"
    )

    gen = torch.Generator().manual_seed(1)
    all_equal = True
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.dim, generator=gen).to(device)
        target = torch.randn(args.tokens, args.dim, generator=gen).to(device)

        ref_loss = nn.functional.mse_loss(forward(ref_layers, x), target)
        ref_loss.backward()

        loss = nn.functional.mse_loss(forward(layers, x, ctx, sync), target)
        loss.backward()  # outside the context: offloaded groups are reloaded here

        equal = torch.equal(loss, ref_loss) and all(
            p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
            for p, q in zip(layers.parameters(), ref_layers.parameters(), strict=True)
        )
        all_equal &= equal
        print(
            f"step {step}: loss {loss.item():.6f} (without offloading {ref_loss.item():.6f}), "
            f"grads equal: {equal}"
        )
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)

    stats = getattr(ctx, "stats", None)  # offload's context has stats; TE's has none
    if stats is not None:
        per_layer = ", ".join(
            f"{la.index}:{format_bytes(la.bytes_offloaded)}" for la in stats.layers
        )
        print(f"offloaded in the last step: {format_bytes(stats.bytes_offloaded)} ({per_layer})")
    print(f"grads equal: {all_equal}")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
