"""Activation offloading with FSDP2 (``fully_shard``), one process per device.

Each transformer block and then the root model are wrapped with
``torch.distributed.fsdp.fully_shard``; ``offload.ActivationOffloader`` offloads the
activations the blocks save for backward (all blocks but the last, found with
``offload.find_layers``). FSDP's all-gathers and reduce-scatters run as usual: the
offloader only touches the saved activations, and FSDP's unsharded parameters are
recognised as parameters and never copied (reason ``parameter`` in the stats).

Run:
    torchrun --nproc_per_node 2 examples/fsdp2.py             # NCCL on GPUs, else gloo
    torchrun --nproc_per_node 2 examples/fsdp2.py --steps 5 --dim 1024 --seq 2048
    python examples/fsdp2.py --steps 2                        # one process, world size 1

Without torchrun the script makes a one-process group itself (gloo on CPU, NCCL on a
GPU) on a free local port. With ``--check`` (the default) it also trains an identical
FSDP2 model without offloading on the same batches and compares the losses.

Rank 0 prints, per step, the loss averaged over ranks (and whether it equals the run
without offloading), then the offloader's stats of the last step (bytes sent to the
host, kept by reason, per layer) and ``done``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import offload
from offload.profiling import format_bytes


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument(
        "--min-tensor-bytes",
        type=int,
        default=0,
        help="ActivationOffloader(min_tensor_bytes=...) (default 0: offload everything)",
    )
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train without offloading and compare the losses (default on)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "layers", "dim", "heads", "seq", "batch", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.dim % args.heads:
        p.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.min_tensor_bytes < 0:
        p.error(f"--min-tensor-bytes must be >= 0; got {args.min_tensor_bytes}")
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> torch.device:
    """Join torchrun's group, or make a one-process group; returns this rank's device."""
    if "RANK" not in os.environ:  # plain `python examples/fsdp2.py`
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def build(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The model, sharded: each block first, then the root (embedding, norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # every rank and both runs start from the same weights
    model = Model(args.vocab, args.dim, args.heads, args.layers).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(
    args: argparse.Namespace, device: torch.device, use_offload: bool
) -> tuple[list[float], offload.OffloadStats | None]:
    model = build(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    offloader = (
        offload.ActivationOffloader(
            offload.find_layers(model),
            offload_layers="all",
            min_tensor_bytes=args.min_tensor_bytes,
        )
        if use_offload
        else None
    )
    gen = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
        if offloader is not None:
            with offloader:
                loss = model(ids)
        else:
            loss = model(ids)
        loss.backward()  # reloads happen here, beside FSDP's reduce-scatters
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    stats = None
    if offloader is not None:
        stats = offloader.stats
        offloader.close()
    return losses, stats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        losses, stats = train(args, device, use_offload=True)
        ref = train(args, device, use_offload=False)[0] if args.check else None
        if rank == 0:
            print(f"FSDP2 on {world} process(es), backend {dist.get_backend()}, device {device}")
            for step, loss in enumerate(losses):
                line = f"step {step}: loss {loss:.6f}"
                if ref is not None:
                    line += f" (without offloading {ref[step]:.6f}, equal: {loss == ref[step]})"
                print(line)
            assert stats is not None
            sending = sum(1 for la in stats.layers if la.bytes_offloaded)
            print(
                f"rank 0 offloaded {stats.bytes_offloaded} bytes "
                f"({format_bytes(stats.bytes_offloaded)}) in {sending} of "
                f"{len(stats.layers)} layers"
            )
            print(f"rank 0 stats: {stats.summary()}")
            kept = {k: format_bytes(v) for k, v in stats.bytes_kept.items() if v}
            print(f"rank 0 kept on device by reason: {kept}")
            per_layer = ", ".join(
                f"{la.index}:{format_bytes(la.bytes_offloaded)}" for la in stats.layers
            )
            print(f"rank 0 bytes offloaded per layer: {per_layer}")
            print("done")
        # every rank leaves together: a rank tearing gloo down while another still
        # runs can abort ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
