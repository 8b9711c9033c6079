"""FSDP2 + fused wgrad (offload.integrations.fsdp.use_fused_wgrad) + activation offloading.

Two processes (gloo on the CPU) train a model of four ``offload.nn.Linear`` blocks and an
MoE block (router, two ``GroupedLinear``, an expert that never gets tokens) for 3 steps
of 2 micro-batches each, the first micro-batch without gradient sync
(``set_requires_gradient_sync(False)``: FSDP accumulates unsharded, our layers use
beta = 1 for the second micro-batch) and the second with it (reduce-scatter), with
``ActivationOffloader`` on. The final parameters are compared with a single-process
reference (plain autograd, no FSDP, no fusion) that sees the same 2 x 2 micro-batches per
step (FSDP averages over ranks, so the reference loss is divided by the world size).

Configurations and tolerances (SGD, lr 0.1, parameters of order 0.1 to 1):

- ``fp32``: no mixed precision. The only differences are fp32 rounding: the reduce-scatter
  adds the two ranks' gradients in another order than one process does, and the fused
  GEMM folds the accumulation into the GEMM. ``rtol=1e-5, atol=1e-6`` on the parameters.
- ``bf16``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: our layers
  write fp32 gradients into FSDP's buffers (the dtype-unifying path of the module is
  exercised: biases and the router produce bf16 ``.grad``). Compared with (a) the same
  FSDP run with the layers unfused (plain autograd under FSDP; on the CPU both compute
  each dW in bf16 and accumulate in fp32, so they agree to fp32 rounding of the bf16
  forward: ``rtol=1e-3, atol=1e-4``), and (b) the fp32 reference, on the parameter
  *updates* (final - initial), where bf16 forward/backward rounding (8 bits of mantissa,
  through 5 blocks) allows a relative error of the update's norm of 2e-2 (measured:
  at most 6e-3).
- ``bf16_always_sync``: as ``bf16`` but both micro-batches reduce-scatter (beta = 0
  each time, FSDP adds the sharded gradients). With no unsynced micro-batch before it,
  FSDP would meet fp32 (ours) and bf16 (biases, router) gradients in one reduce-scatter
  and raise; ``use_fused_wgrad`` upcasts the bf16 ones first. Compared with ``bf16``:
  same per-micro-batch gradients, summed before or after the reduce-scatter, so fp32
  rounding only (``rtol=1e-5, atol=1e-6``).

The same worker runs on one GPU (nccl, world size 1) in ``test_fsdp_fused_wgrad_one_gpu``
(marker ``cuda``), where the fused layers use the fp32-output GEMM.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.nn import GroupedLinear, Linear

D, FF, E, TOKENS = 16, 32, 4, 24
STEPS, MICRO_BATCHES, LR = 3, 2, 0.1
WORLD = 2
CONFIGS = ("fp32", "bf16", "bf16_unfused", "bf16_always_sync")
REPO = Path(__file__).resolve().parents[2]


class DenseBlock(nn.Module):
    def __init__(self, fuse: bool) -> None:
        super().__init__()
        self.fc = Linear(D, D, fuse_wgrad_accumulation=fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class MoEBlock(nn.Module):
    """Top-1 MoE with a fixed routing (token t -> expert t % 3; expert 3 gets nothing).

    The routing is fixed so that bf16 and fp32 runs route identically; the router still
    learns through the gate probabilities.
    """

    def __init__(self, fuse: bool) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.fc1 = GroupedLinear(E, D, FF, fuse_wgrad_accumulation=fuse)
        self.fc2 = GroupedLinear(E, FF, D, fuse_wgrad_accumulation=fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = torch.arange(x.shape[0], device=x.device) % (E - 1)
        probs = torch.softmax(self.router(x).float(), dim=-1)
        gate = probs.gather(1, expert[:, None]).to(x.dtype)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=E).cpu()  # CPU int tensor: no device sync
        y = self.fc2(F.gelu(self.fc1(x[order], counts)), counts)
        return x + y[torch.argsort(order)] * gate


class Model(nn.Module):
    def __init__(self, fuse: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DenseBlock(fuse) for _ in range(4)] + [MoEBlock(fuse)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


def build(fuse: bool) -> Model:
    torch.manual_seed(0)
    return Model(fuse)


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(TOKENS, D, generator=g)


def reference(world: int) -> dict[str, torch.Tensor]:
    model = build(fuse=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            for rank in range(world):
                (model(batch(step, micro, rank)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_fsdp(config: str, rank: int, world: int, device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from offload.integrations.fsdp import use_fused_wgrad

    fuse = config != "bf16_unfused"
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.startswith("bf16")
        else MixedPrecisionPolicy()
    )
    model = build(fuse).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    routed = use_fused_wgrad(model) if fuse else []
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    off = offload.ActivationOffloader(list(model.blocks), offload_layers="all", min_tensor_bytes=0)
    offloaded = []
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            sync = config == "bf16_always_sync" or micro == MICRO_BATCHES - 1
            model.set_requires_gradient_sync(sync)
            with off:
                loss = model(batch(step, micro, rank).to(device))
            loss.backward()
            offloaded.append(off.stats.bytes_offloaded)
        opt.step()
        opt.zero_grad()
    off.close()
    params = {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters()}
    return {"params": params, "routed": len(routed), "offloaded": offloaded}


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    device = torch.device(args.device, args.rank if args.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{args.init}",
        rank=args.rank,
        world_size=args.world,
    )
    try:
        results = {c: _train_fsdp(c, args.rank, args.world, device) for c in CONFIGS}
        if args.rank == 0:
            torch.save(results, Path(args.out) / "results.pt")
        # Without it, a rank that tears gloo down while its peer is still in a collective
        # intermittently aborts ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(tmp_path: Path, world: int, device: str) -> dict:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--device",
                device,
                "--init",
                str(tmp_path / "store"),
                "--out",
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-6000:]}"
    return torch.load(tmp_path / "results.pt")


def _check(results: dict, world: int) -> None:
    ref = reference(world)
    init = {k: v.detach().clone() for k, v in build(fuse=False).state_dict().items()}
    fp32, bf16, bf16_unfused, bf16_sync = (results[c] for c in CONFIGS)
    # every fused layer was routed: 4 dense blocks + fc1 + fc2
    assert fp32["routed"] == bf16["routed"] == bf16_sync["routed"] == 6
    assert bf16_unfused["routed"] == 0
    # activation offloading really moved something in every micro-batch
    assert all(n > 0 for r in results.values() for n in r["offloaded"])
    assert set(fp32["params"]) == set(ref)
    for name, expected in ref.items():
        torch.testing.assert_close(fp32["params"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(
            bf16["params"][name], bf16_unfused["params"][name], rtol=1e-3, atol=1e-4, msg=name
        )
        torch.testing.assert_close(
            bf16_sync["params"][name], bf16["params"][name], rtol=1e-5, atol=1e-6, msg=name
        )
        update = bf16["params"][name] - init[name]
        ref_update = expected - init[name]
        if name.endswith("weight3") or name.endswith("bias3"):  # the expert without tokens
            assert not update.any() and not ref_update.any(), name
            continue
        err = (update - ref_update).norm() / ref_update.norm()
        assert err < 2e-2, f"{name}: relative error of the bf16 update {err:.3g}"


@pytest.mark.distributed
def test_fsdp2_fused_wgrad_matches_single_process(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    _check(_launch(tmp_path, WORLD, "cpu"), WORLD)


@pytest.mark.cuda
@pytest.mark.distributed
def test_fsdp_fused_wgrad_one_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (FSDP2 with nccl, world size 1)")
    _check(_launch(tmp_path, 1, "cuda"), 1)


@pytest.mark.cuda
@pytest.mark.distributed
def test_fsdp_fused_wgrad_two_gpus(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (FSDP2 with nccl, world size 2)")
    _check(_launch(tmp_path, 2, "cuda"), 2)


def test_use_fused_wgrad_errors():
    from offload.integrations.fsdp import use_fused_wgrad

    with pytest.raises(TypeError, match=r"use_fused_wgrad\(model=\.\.\.\)"):
        use_fused_wgrad("model")
    with pytest.raises(ValueError, match="no submodule of Model is managed by fully_shard"):
        use_fused_wgrad(build(fuse=True))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", required=True)
    _worker(parser.parse_args())
    # The work is done and checked by the parent from what rank 0 saved. Interpreter
    # shutdown after gloo's teardown intermittently aborts in torch's C++ destructors
    # ("terminate called without an active exception", "malloc(): unaligned tcache chunk
    # detected"), after destroy_process_group has returned (this package starts no
    # threads), so the worker leaves without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
