"""``offload.checkpoint`` on a CUDA GPU: bitwise-equal gradients in bf16 (dropout
included), the peak memory drops by about the checkpoint inputs, no host
synchronisation and no new pinned memory in steady state, a late side stream, Hugging
Face. Run on the GPU with
``PYTHONPATH=. python3 -m pytest -q -m cuda tests/recompute/test_checkpoint_cuda.py``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same, twin

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"


class DropoutBlock(nn.Module):
    """A Llama block with dropout on the attention input and in the MLP: the
    recomputation must redraw the same masks from the restored CUDA RNG state."""

    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.block = models.LlamaBlock(dim, heads, ffn)
        self.fc = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(F.dropout(x, 0.1, self.training))
        return x + F.dropout(self.fc(x), 0.2, self.training)


def stack(kind: str = "llama", n: int = 4, dim: int = 256, heads: int = 4, ffn: int = 512):
    torch.manual_seed(0)
    cls = models.LlamaBlock if kind == "llama" else DropoutBlock
    return nn.ModuleList(cls(dim, heads, ffn) for _ in range(n)).to(DEV, torch.bfloat16)


def runner(ckpt):
    def run(layers, x):
        for layer in layers:
            x = ckpt(layer, x)
        return x

    return run


def torch_ckpt(function, x):
    return torch_checkpoint(function, x, use_reentrant=False)


def no_ckpt(function, x):
    return function(x)


def seeded(layers, x, fn, seed=123):
    torch.manual_seed(seed)  # CPU and CUDA generators: every run draws the same masks
    return models.step(layers, x, runner(fn))


@pytest.mark.parametrize("kind", ["llama", "dropout"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_bf16_bitwise_equal_to_torch_and_no_checkpointing(kind, prefetch) -> None:
    layers = stack(kind)
    ref = twin(layers)
    off = offload.CheckpointOffloader(min_tensor_bytes=0, prefetch_layers=prefetch)
    for _ in range(3):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
        want = seeded(ref, x, torch_ckpt)
        assert_same(seeded(ref, x, torch_ckpt), want)  # control: deterministic reference
        assert_same(seeded(ref, x, no_ckpt), want)
        assert_same(seeded(layers, x, off.checkpoint), want)
        s = off.stats
        assert s.bytes_offloaded == 4 * x.nbytes and s.bytes_reloaded == s.bytes_offloaded
        expect = 0 if prefetch == 0 else 3
        assert (s.reloads_prefetched, s.reloads_on_demand) == (expect, 4 - expect)
        assert s.host_pool_bytes == 0
        off.reset_stats()
    if kind == "dropout":
        assert not torch.equal(seeded(layers, x, off.checkpoint, seed=5)[0], want[0])
    off.close()


def test_originals_freed_and_late_side_stream() -> None:
    """The inputs' storages are gone before backward; with a compute stream that runs
    late (a long kernel queued first), the copies still wait for it (4.1(a)-(c))."""
    layers = stack(n=4)
    ref = twin(layers)
    off = offload.CheckpointOffloader(min_tensor_bytes=0)
    side = torch.cuda.Stream()
    for _ in range(3):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
        want = models.step(ref, x, runner(torch_ckpt))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
            for p in layers.parameters():
                p.grad = None
            h0 = x.clone().requires_grad_(True)
            h, probes = h0 * 1.0, []
            for layer in layers:
                probes.append(StorageWeakRef(h.untyped_storage()))
                torch.cuda._sleep(200_000)  # the D2H must not start before this
                h = off.checkpoint(layer, h)
            loss = h.float().square().mean()
            del h
            assert all(p.expired() for p in probes)
            loss.backward()
            got = (loss.detach(), [p.grad.clone() for p in layers.parameters()], h0.grad)
        torch.cuda.current_stream().wait_stream(side)
        assert_same(got, want)


def _step_peak(layers, make_input, ckpt) -> int:
    """Peak allocated during one step above what was allocated before it. Gradients are
    zeroed, not freed (persistent buffers), so the step's peak is the activations' own:
    the backward of the last layer, when torch's checkpoint holds every layer's input."""
    for p in layers.parameters():
        if p.grad is not None:
            p.grad.zero_()
    box = [make_input()]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    h = box.pop()  # only the checkpoint (or nothing) keeps layer 0's input
    for layer in layers:
        h = ckpt(layer, h)
    loss = h.float().square().mean()
    del h
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("prefetch", [1, 2])
def test_peak_memory_drops_by_the_checkpoint_inputs(prefetch) -> None:
    n = 8
    layers = stack(n=n, dim=1024, heads=8, ffn=2816)
    shape = (1, 8192, 1024)  # 16 MiB of bf16 per layer input

    def make_input():
        return torch.randn(shape, device=DEV, dtype=torch.bfloat16)

    inputs = 16 << 20
    off = offload.CheckpointOffloader(prefetch_layers=prefetch)
    for _ in range(2):  # warm up allocator, pool, cuBLAS; allocates the gradients
        _step_peak(layers, make_input, torch_ckpt)
        _step_peak(layers, make_input, off.checkpoint)
    plain = _step_peak(layers, make_input, torch_ckpt)
    off.reset_stats()
    ours = _step_peak(layers, make_input, off.checkpoint)
    drop = plain - ours
    # at the peak (backward of the last layer) torch holds all n inputs; offloaded, the
    # last layer's input (reloaded on demand) and `prefetch` prefetched ones are back
    expect = (n - 1 - prefetch) * inputs
    assert expect - inputs <= drop <= n * inputs, (drop / inputs, plain, ours)
    print(f"peak drop: {drop / inputs:.2f} inputs of 16 MiB (expected ~{n - 1 - prefetch})")
    assert off.stats.bytes_offloaded == n * inputs
    off.close()


def _count_syncs(step) -> int:
    """Synchronizing CUDA calls made by ``step()``, counted in ``"warn"`` mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_no_host_sync_and_no_new_pinned_memory_in_steady_state() -> None:
    layers = stack(kind="dropout")
    off = offload.CheckpointOffloader(min_tensor_bytes=0)
    x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)

    def steps(ckpt, n=3):
        for _ in range(n):
            for p in layers.parameters():
                p.grad = None
            h = x * 1.0
            for layer in layers:
                h = ckpt(layer, h)
            loss = h.float().square().mean()
            del h
            loss.backward()

    for _ in range(2):
        steps(off.checkpoint, 1)
        steps(torch_ckpt, 1)
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()
    reserved = off.stats.host_pool_reserved_bytes
    off.reset_stats()
    # control: torch's own checkpoint (RNG state stashing and restoring included)
    control = _count_syncs(lambda: steps(torch_ckpt))
    if control == 0:
        torch.cuda.set_sync_debug_mode("error")
        try:
            steps(off.checkpoint)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:  # this torch synchronizes in its own checkpoint: we must add none (its count
        # can vary with what ran before in the process: 1 after the planner's tests)
        assert _count_syncs(lambda: steps(off.checkpoint)) <= control
    torch.cuda.synchronize()
    after = torch.cuda.host_memory_stats()
    for key in before:
        if "alloc" in key and "current" not in key and "peak" not in key and "bytes" not in key:
            assert before[key] == after[key], (key, before[key], after[key])
    s = off.stats
    assert s.host_pool_reserved_bytes == reserved
    assert s.bytes_offloaded == s.bytes_reloaded == 3 * 4 * x.nbytes
    off.close()


def test_100_steps_race_stress_and_no_growth() -> None:
    """Tiny layers (copies dominate), fresh inputs every step: every step bitwise
    equal, device memory and the host pool flat."""
    torch.manual_seed(0)
    layers = nn.ModuleList(models.InplaceBlock(256) for _ in range(6)).to(DEV)
    ref = twin(layers)
    off = offload.CheckpointOffloader(min_tensor_bytes=0, prefetch_layers=2)
    allocated, pool = [], []
    for i in range(100):
        x = torch.randn(64, 64, 256, device=DEV)  # 4 MiB per input
        assert_same(
            models.step(layers, x, runner(off.checkpoint)), models.step(ref, x, runner(torch_ckpt))
        )
        if i >= 10:
            allocated.append(torch.cuda.memory_allocated())
            s = off.stats
            pool.append((s.host_pool_bytes, s.host_pool_reserved_bytes))
    assert max(allocated) == min(allocated)
    assert len(set(pool)) == 1 and pool[0][0] == 0


def test_hf_llama_bf16_sdpa() -> None:
    transformers = pytest.importorskip("transformers")
    from offload.integrations.hf import offload_checkpointing

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(DEV, torch.bfloat16)
    model.train()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    off = offload.CheckpointOffloader(min_tensor_bytes=0)
    handle = offload_checkpointing(model, offloader=off)
    for _ in range(2):
        ids = torch.randint(0, 256, (2, 512), device=DEV)
        loss = model(ids, labels=ids).loss
        loss.backward()
        want = ref(ids, labels=ids).loss
        want.backward()
        assert torch.equal(loss, want)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.grad, q.grad), name
            p.grad = q.grad = None
    # every layer's hidden states (bf16), each step
    assert off.stats.bytes_offloaded == 2 * 4 * 2 * 512 * 256 * 2
    handle.remove()
    off.close()
