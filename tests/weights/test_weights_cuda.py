"""WeightOffloader on a CUDA GPU: bitwise-equal training in bf16 (gradients on the device
and on the host, LoRA, fused wgrad, with and without ActivationOffloader), races between
the copy streams and the compute stream, peak memory, no host syncs and no new pinned
memory in steady state. Run on the GPU with
``PYTHONPATH=. python3 -m pytest -m cuda tests/weights/test_weights_cuda.py``."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"
BF16 = torch.bfloat16


def llama(n: int = 4, dim: int = 256, heads: int = 4, ffn: int = 512) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(models.LlamaBlock(dim, heads, ffn) for _ in range(n)).to(DEV, BF16)


def batches(steps: int, shape=(2, 256, 256)) -> list[torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(1)
    return [torch.randn(*shape, device=DEV, dtype=BF16, generator=g) for _ in range(steps)]


def loss_of(layers, x) -> torch.Tensor:
    return models.run_plain(layers, x).float().square().mean()


def equal_lists(got, want) -> None:
    got, want = list(got), list(want)
    assert len(got) == len(want) and got
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.cpu(), b.cpu()), (
            f"tensor {i} differs: {(a.float().cpu() - b.float().cpu()).abs().max()}"
        )


def equal_states(opt_a, params_a, opt_b, params_b) -> None:
    for pa, pb in zip(params_a, params_b):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]).cpu(), torch.as_tensor(sb[key]).cpu()), key


def check_freed(layers) -> None:
    assert all(p.untyped_storage().nbytes() == 0 for p in layers.parameters())


# ---- bitwise training ------------------------------------------------------------------


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_bf16_training_grads_on_device_bitwise(activations: bool, prefetch: int) -> None:
    layers, ref = llama(), llama()
    xs = batches(3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for x in xs:
        loss_of(ref, x.clone().requires_grad_(True)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    off = offload.WeightOffloader(layers, prefetch_layers=prefetch)
    acts = (
        offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
        if activations
        else None
    )
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    for x in xs:
        with acts if acts is not None else contextlib.nullcontext():
            loss = loss_of(layers, x.clone().requires_grad_(True))
        loss.backward()
        check_freed(layers)
        if x is xs[0]:  # before resident() brings every layer back for the step
            assert off.max_resident_layers == prefetch + 1
        with off.resident():
            opt.step()
        opt.zero_grad()
        if acts is not None:
            assert acts.stats.bytes_offloaded > 0 and acts.stats.bytes_kept["parameter"] > 0
    equal_states(opt, list(layers.parameters()), ref_opt, list(ref.parameters()))
    off.close()
    equal_lists(layers.parameters(), ref.parameters())
    if acts is not None:
        acts.close()


@pytest.mark.parametrize("activations", [False, True])
def test_bf16_training_grads_on_host_bitwise(activations: bool) -> None:
    """Reference: the same bf16 model on the GPU, its gradients moved to fp32 CPU masters
    stepped by a CPU AdamW and copied back in bf16 (what grads="host" automates)."""
    layers, ref = llama(), llama()
    xs = batches(3)
    masters = [p.detach().to("cpu", torch.float32) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-3)
    for x in xs:
        loss_of(ref, x.clone().requires_grad_(True)).backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.to("cpu", torch.float32)
            p.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m.to(BF16).to(DEV))
    off = offload.WeightOffloader(layers, grads="host")
    acts = (
        offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
        if activations
        else None
    )
    opt = torch.optim.AdamW(off.host_parameters(), lr=1e-3)
    for x in xs:
        with acts if acts is not None else contextlib.nullcontext():
            loss = loss_of(layers, x.clone().requires_grad_(True))
        loss.backward()
        assert all(p.grad is None for p in layers.parameters())
        check_freed(layers)
        opt.step()
        opt.zero_grad()
        off.push()
    equal_states(opt, off.host_parameters(), ref_opt, masters)
    assert off._grad_pool is not None and off._grad_pool.in_use_bytes == 0
    off.close()
    equal_lists(layers.parameters(), ref.parameters())
    if acts is not None:
        acts.close()


class LoraBlock(nn.Module):
    def __init__(self, dim: int, rank: int = 8) -> None:
        super().__init__()
        self.base1 = nn.Linear(dim, 4 * dim, bias=False).requires_grad_(False)
        self.base2 = nn.Linear(4 * dim, dim, bias=False).requires_grad_(False)
        self.a1 = nn.Parameter(torch.randn(rank, dim) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(4 * dim, rank) + 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base1(x) + F.linear(F.linear(x, self.a1), self.b1)
        return x + self.base2(F.gelu(h))


def test_bf16_lora_and_inference_bitwise() -> None:
    def build():
        torch.manual_seed(0)
        return nn.ModuleList(LoraBlock(512) for _ in range(4)).to(DEV, BF16)

    layers, ref = build(), build()
    xs = batches(3, (2, 256, 512))
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=1e-3)
    for x in xs:
        loss_of(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    off = offload.WeightOffloader(layers)
    params = [p for p in layers.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for x in xs:
        loss_of(layers, x).backward()
        check_freed(layers)
        with off.resident(params):
            opt.step()
        opt.zero_grad()
    with torch.no_grad():  # inference
        for x in xs:
            assert torch.equal(models.run_plain(layers, x), models.run_plain(ref, x))
    check_freed(layers)
    equal_states(opt, params, ref_opt, trainable)
    off.close()
    equal_lists(layers.parameters(), ref.parameters())


class FusedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = offload.nn.Linear(dim, 4 * dim, fuse_wgrad_accumulation=True)
        self.fc2 = offload.nn.Linear(4 * dim, dim, bias=False, fuse_wgrad_accumulation=True)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


@pytest.mark.parametrize("grads", ["device", "host"])
def test_bf16_fused_wgrad_bitwise(grads: str) -> None:
    """bf16 weights, fp32 main_grad written by the fp32-output GEMM. grads="device": two
    micro-batches accumulate in the user's main_grad, as without offloading. grads="host":
    the GEMM writes a zeroed device staging buffer, added into the host main_grad (one
    micro-batch: a GEMM with beta = 1 into a non-zero buffer rounds differently from
    adding its result afterwards, so two would agree only to fp32 rounding)."""

    def build():
        torch.manual_seed(0)
        return nn.ModuleList(FusedBlock(256) for _ in range(3)).to(DEV, BF16)

    layers, ref = build(), build()
    xs = batches(2 if grads == "device" else 1)
    offload.main_grad.attach(ref)
    for x in xs:
        loss_of(ref, x.clone().requires_grad_(True)).backward()
    if grads == "device":
        offload.main_grad.attach(layers)
        off = offload.WeightOffloader(layers)
        for x in xs:
            loss_of(layers, x.clone().requires_grad_(True)).backward()
        check_freed(layers)
        equal_lists(
            [p.main_grad for p in layers.parameters()], [p.main_grad for p in ref.parameters()]
        )
        equal_lists(
            [p.grad for p in layers.parameters() if p.grad is not None],
            [p.grad for p in ref.parameters() if p.grad is not None],
        )
    else:
        off = offload.WeightOffloader(layers, grads="host")
        for x in xs:
            loss_of(layers, x.clone().requires_grad_(True)).backward()
        check_freed(layers)
        assert not any(hasattr(p, "main_grad") for p in layers.parameters())
        for m, p in zip(off.host_parameters(), ref.parameters()):
            # fused weights: their fp32 main_grad; biases and norms: their bf16 .grad
            want = p.main_grad if p.grad is None else p.grad.float()
            assert torch.equal(m.grad, want.cpu())
    off.close()


# ---- races ------------------------------------------------------------------------------


class SlowBlock(nn.Module):
    """A large weight and little compute, plus a device-side sleep before the weight is
    read: the compute stream lags far behind the host, so a copy stream that did not
    wait for it would overwrite blocks still in use, and a compute stream that did not
    wait for a copy would read half-copied weights."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim, bias=False)
        self.sleep = 0

    def forward(self, x):
        if self.sleep:
            torch.cuda._sleep(self.sleep)
        return x + self.fc(x)


@pytest.mark.parametrize("sleep", [0, 2_000_000])
def test_race_stress_slow_compute_and_large_copies(sleep: int) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(SlowBlock(4096) for _ in range(8)).to(DEV, BF16)  # 32 MiB each
    ref = copy.deepcopy(layers)
    for layer in layers:
        layer.sleep = sleep
    off = offload.WeightOffloader(layers)
    for it in range(5):
        x = torch.randn(4, 4096, device=DEV, dtype=BF16)
        with torch.no_grad():
            want = models.run_plain(ref, x)
            got = models.run_plain(layers, x)
        assert torch.equal(got, want), it
        xg = x.clone().requires_grad_(True)
        models.run_plain(layers, xg).float().sum().backward()
        xr = x.clone().requires_grad_(True)
        models.run_plain(ref, xr).float().sum().backward()
        assert torch.equal(xg.grad, xr.grad), it
        for a, b in zip(layers.parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad), it
            a.grad = b.grad = None
    off.close()


# ---- memory, syncs, pinned memory --------------------------------------------------------


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("mode", ["inference", "lora", "train"])
def test_peak_memory_falls_by_offloaded_weights(mode: str) -> None:
    """Peak allocated falls by the offloaded weight bytes minus at most two layers
    (prefetch_layers=1: the running layer and the next)."""
    if mode == "lora":
        torch.manual_seed(0)
        layers = nn.ModuleList(LoraBlock(1024) for _ in range(8)).to(DEV, BF16)
    else:
        layers = llama(n=8, dim=1024, heads=8, ffn=4096)
        if mode == "inference":
            layers.requires_grad_(False)
    x = torch.randn(2, 512, 1024, device=DEV, dtype=BF16)

    def step():
        if mode == "inference":
            with torch.no_grad():
                models.run_plain(layers, x)
            return
        for p in layers.parameters():
            if p.grad is not None:
                p.grad.zero_()  # zeroed, not freed: backward allocates no new .grad
        loss_of(layers, x.clone().requires_grad_(mode == "train")).backward()

    for _ in range(2):
        step()
    without = _peak(step)
    total = sum(p.numel() * p.element_size() for p in layers.parameters())
    layer = total // len(layers)
    off = offload.WeightOffloader(layers)
    assert off.bytes_offloaded == total
    for _ in range(2):
        step()
    with_ = _peak(step)
    saved = without - with_
    assert saved >= total - 2 * layer - (1 << 20), (mode, saved, total, layer, without, with_)
    assert off.max_resident_layers <= 2
    print(
        f"{mode}: peak {without / 2**20:.0f} -> {with_ / 2**20:.0f} MiB, weights {total / 2**20:.0f} MiB"
    )
    off.close()


@pytest.mark.parametrize("grads", ["device", "host"])
def test_steady_state_no_host_sync_no_new_pinned_memory(grads: str) -> None:
    layers = llama(n=4, dim=512, heads=8, ffn=1024)
    off = offload.WeightOffloader(layers, grads=grads)
    acts = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(2, 512, 512, device=DEV, dtype=BF16)

    def step():
        with acts:
            loss = loss_of(layers, x)
        loss.backward()
        if grads == "device":
            with off.resident(), torch.no_grad():  # an SGD step: weights written back
                for p in layers.parameters():
                    p.add_(p.grad, alpha=-1e-4)
                    p.grad = None

    for _ in range(3):
        step()
    if grads == "host":
        off.push()
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()
    pinned = off.pinned_bytes
    refills, on_demand = off.refills, off.refills_on_demand
    # grads="host" waits on the host by design (end of backward, push()); its
    # Event.synchronize is not a sync the debug mode reports, so check the rest there.
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = torch.cuda.host_memory_stats()
    for key in before:
        if "alloc" in key and "current" not in key and "peak" not in key and "bytes" not in key:
            assert before[key] == after[key], (key, before[key], after[key])
    assert off.pinned_bytes == pinned
    per_step = (off.refills - refills) // 3
    assert (off.refills_on_demand - on_demand) // 3 == 1  # only the first layer's forward
    assert per_step >= 2 * len(layers) - 1
    check_freed(layers)
    off.close()
    acts.close()


def test_state_dict_and_close_on_gpu() -> None:
    layers = llama(n=3)
    want = {k: v.clone() for k, v in layers.state_dict().items()}
    off = offload.WeightOffloader(layers)
    check_freed(layers)
    sd = layers.state_dict()
    for k, v in want.items():
        assert sd[k].device.type == "cpu" and torch.equal(sd[k], v.cpu()), k
    new = {k: torch.randn_like(v) for k, v in want.items()}
    layers.load_state_dict(new)
    check_freed(layers)
    assert all(torch.equal(v, new[k].cpu()) for k, v in layers.state_dict().items())
    off.close()
    assert all(torch.equal(v, new[k]) for k, v in layers.state_dict().items())
    assert all(p.device.type == "cuda" for p in layers.parameters())


def test_parameters_on_the_cpu_warn_and_still_work() -> None:
    layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
    with pytest.warns(UserWarning, match="saves nothing"):
        off = offload.WeightOffloader(layers)
    models.run_plain(layers, torch.randn(2, 16)).sum().backward()
    off.close()


def test_mixed_devices_are_refused() -> None:
    layers = [nn.Linear(16, 16).to(DEV), nn.Linear(16, 16)]
    with pytest.raises(ValueError, match="one WeightOffloader per device"):
        offload.WeightOffloader(layers)
    assert all(p.untyped_storage().nbytes() > 0 for layer in layers for p in layer.parameters())
