"""Tensor kinds on the GPU: torchao float8 training, an FP8 activation cache, autocast
with fp32 weights on the ref-8L shapes (docs/design.md 4.7, 4.8). torchao is optional: its
test skips without it (on the GPU machine it is carried as a wheel)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from tests import models
from tests.activations.test_tensor_kinds import FP8Block
from tests.models import ON_CUDA, assert_same, twin

pytestmark = ON_CUDA


class MLP(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_float8_training_same_gradients(recipe: str) -> None:
    float8 = pytest.importorskip("torchao.float8")
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        layers = nn.ModuleList(MLP(1024, 2048) for _ in range(4)).cuda().to(torch.bfloat16)
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        float8.convert_to_float8_training(layers, config=config)
        assert any(type(m).__name__ == "Float8Linear" for m in layers.modules())
        ref = twin(layers)
        off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
        for _ in range(2):
            x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
            want = models.step(ref, x, models.run_plain)
            assert_same(models.step(ref, x, models.run_plain), want)  # control
            assert_same(models.step(layers, x, models.run_plain, off), want)
            assert all(la.bytes_offloaded > 0 for la in off.stats.layers[:3])
    finally:
        torch.use_deterministic_algorithms(False)


def test_fp8_activation_cache_offloads_one_byte_per_element() -> None:
    torch.manual_seed(0)
    dim, n = 1024, 4096
    layers = nn.ModuleList(FP8Block(dim) for _ in range(3)).cuda()
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=1024)
    x = torch.randn(n, dim, device="cuda")
    got = models.step(layers, x, models.run_plain, off)
    want = models.step(ref, x, models.run_plain)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    assert off.stats.bytes_by_dtype["float8_e4m3fn"] == 2 * n * dim  # two offloaded layers


def test_autocast_ref8l_sends_only_activations() -> None:
    """ref-8L layer shapes, fp32 weights, bf16 autocast: F.linear saves weight.to(bf16).t();
    nothing that travels may have a weight's shape, and the casts are kept as
    'parameter'."""
    # seq 2048, not ref-8L's 4096: with seq == hidden a flattened (seq, hidden) input
    # has a weight's shape, and the shape check below could not tell them apart
    dim, heads, ffn, seq, n = 4096, 32, 14336, 2048, 8
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(dim, heads, ffn) for _ in range(n)).cuda()
    weight_shapes = set()
    for p in layers.parameters():
        if p.dim() == 2:
            weight_shapes |= {tuple(p.shape), tuple(p.shape[::-1])}
    candidates = []

    def record(t: torch.Tensor) -> bool:  # called only for tensors about to be offloaded
        candidates.append((tuple(t.shape), t.dtype))
        return True

    off = offload.ActivationOffloader(layers, offload_layers="all", tensor_filter=record)
    x = torch.randn(1, seq, dim, device="cuda")
    for _ in range(2):
        candidates.clear()
        for p in layers.parameters():
            p.grad = None
        with off:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = models.run_plain(layers, x).float().square().mean()
        loss.backward()
    stats = off.stats
    assert candidates and all(shape not in weight_shapes for shape, _ in candidates)
    bf16_weights = sum(p.numel() * 2 for p in layers[1].parameters() if p.dim() == 2)
    for la in stats.layers[1:7]:
        assert la.bytes_kept["parameter"] >= bf16_weights  # the autocast casts, kept
        assert la.bytes_offloaded > 0
    print("autocast ref-8L bytes offloaded per layer:", [la.bytes_offloaded for la in stats.layers])
