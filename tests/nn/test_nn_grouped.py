"""offload.nn.GroupedLinear: MoE experts, per-expert fused wgrad (docs/design.md 4.9).

The reference is one ``nn.Linear`` per expert applied to its rows. Tolerances as in
test_nn_linear.py: fp32 on the CPU, the fused ``main_grad.addmm_(..., beta=1)`` may add
``main_grad`` into the GEMM's partial sums at another point than "dW, then +=", so
results agree to fp32 rounding (``rtol=1e-5, atol=1e-6``), not necessarily bitwise.
Experts without tokens are checked exactly: their buffers are never touched in
accumulate mode (a sentinel value survives bit for bit) and are exactly zero in
overwrite mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import offload
from offload.nn import GroupedLinear

RTOL, ATOL = 1e-5, 1e-6
E, IN, OUT = 4, 16, 12
# expert 2 never gets tokens; expert 0 gets none in the second micro-batch
SPLITS = [[3, 5, 0, 2], [0, 4, 0, 6], [2, 2, 0, 1]]


def _pair(bias: bool = True, fuse: bool = True) -> tuple[GroupedLinear, list[nn.Linear]]:
    torch.manual_seed(0)
    grouped = GroupedLinear(E, IN, OUT, bias=bias, fuse_wgrad_accumulation=fuse)
    refs = []
    for i in range(E):
        ref = nn.Linear(IN, OUT, bias=bias)
        with torch.no_grad():
            ref.weight.copy_(getattr(grouped, f"weight{i}"))
            if bias:
                ref.bias.copy_(getattr(grouped, f"bias{i}"))
        refs.append(ref)
    return grouped, refs


def _reference(refs: list[nn.Linear], x: torch.Tensor, splits: list[int]) -> torch.Tensor:
    return torch.cat([ref(xi) for ref, xi in zip(refs, x.split(splits), strict=True)])


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sin().sum()


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(sum(s), IN, generator=g) for s in SPLITS]


def test_parameters_layout_and_init():
    grouped, _ = _pair()
    names = [n for n, _ in grouped.named_parameters()]
    assert names == [f"weight{i}" for i in range(E)] + [f"bias{i}" for i in range(E)]
    assert list(grouped.state_dict()) == names
    bound = 1 / math.sqrt(IN)  # nn.Linear's init bounds for both weight and bias
    for p in grouped.parameters():
        assert p.abs().max() <= bound
    no_bias = GroupedLinear(E, IN, OUT, bias=False)
    assert [n for n, _ in no_bias.named_parameters()] == [f"weight{i}" for i in range(E)]
    assert no_bias.bias0 is None
    assert "num_experts=4" in repr(grouped)


@pytest.mark.parametrize("bias", [True, False])
def test_unfused_forward_and_grads_match_per_expert_linear(bias):
    grouped, refs = _pair(bias, fuse=False)
    for x, splits in zip(_inputs(), SPLITS, strict=True):
        xg = x.clone().requires_grad_()
        xr = x.clone().requires_grad_()
        yg = grouped(xg, splits)
        yr = _reference(refs, xr, splits)
        torch.testing.assert_close(yg, yr, rtol=RTOL, atol=ATOL)
        _loss(yg).backward()
        _loss(yr).backward()
        torch.testing.assert_close(xg.grad, xr.grad, rtol=RTOL, atol=ATOL)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(
            getattr(grouped, f"weight{i}").grad, ref.weight.grad, rtol=RTOL, atol=ATOL
        )
        if bias:
            torch.testing.assert_close(
                getattr(grouped, f"bias{i}").grad, ref.bias.grad, rtol=RTOL, atol=ATOL
            )
    assert not grouped.weight2.grad.any()  # no tokens: a zero gradient, as nn.Linear gives


def test_accumulate_three_micro_batches_with_an_empty_expert():
    grouped, refs = _pair()
    offload.main_grad.attach(grouped)
    sentinel = [float(i + 1) for i in range(E)]  # accumulate mode adds to what is there
    for i in range(E):
        getattr(grouped, f"weight{i}").main_grad.fill_(sentinel[i])
    for x, splits in zip(_inputs(), SPLITS, strict=True):
        _loss(grouped(x.requires_grad_(), splits)).backward()
        _loss(_reference(refs, x, splits)).backward()
    for i, ref in enumerate(refs):
        w = getattr(grouped, f"weight{i}")
        assert w.grad is None
        torch.testing.assert_close(w.main_grad, ref.weight.grad + sentinel[i], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(
            getattr(grouped, f"bias{i}").grad, ref.bias.grad, rtol=RTOL, atol=ATOL
        )
    # expert 2 never had tokens: untouched, bit for bit
    assert torch.equal(grouped.weight2.main_grad, torch.full((OUT, IN), sentinel[2]))


def test_overwrite_mode_keeps_last_micro_batch_and_zeroes_empty_expert():
    grouped, refs = _pair()
    offload.main_grad.attach(grouped)
    for i in range(E):
        w = getattr(grouped, f"weight{i}")
        w.overwrite_main_grad = True
        w.main_grad.fill_(float("nan"))
    for x, splits in zip(_inputs(), SPLITS, strict=True):
        for ref in refs:
            ref.weight.grad = None
        _loss(grouped(x, splits)).backward()
        _loss(_reference(refs, x, splits)).backward()
    for i, ref in enumerate(refs):
        torch.testing.assert_close(
            getattr(grouped, f"weight{i}").main_grad, ref.weight.grad, rtol=RTOL, atol=ATOL
        )
    assert torch.equal(grouped.weight2.main_grad, torch.zeros(OUT, IN))
    # expert 0 had tokens before but none in the second batch: zeros were written then,
    # and the third batch overwrote them again
    assert torch.isfinite(grouped.weight0.main_grad).all()


def test_grad_added_to_main_grad_sets_flag_and_returns_dummies():
    grouped, _ = _pair()
    offload.main_grad.attach(grouped)
    seen: dict[int, torch.Tensor] = {}
    for i in range(E):
        w = getattr(grouped, f"weight{i}")
        w.grad_added_to_main_grad = False
        w.register_hook(lambda g, i=i: seen.__setitem__(i, g))
    x = _inputs()[0]
    _loss(grouped(x, SPLITS[0])).backward()
    for i in range(E):
        assert getattr(grouped, f"weight{i}").grad_added_to_main_grad is True
        assert seen[i].stride() == (0, 0) and not seen[i].any()


def test_missing_main_grad_names_attach():
    grouped, _ = _pair()
    x = _inputs()[0]
    with pytest.raises(RuntimeError, match=r"offload\.main_grad\.attach.*") as info:
        grouped(x, SPLITS[0])
    assert "weight0" in str(info.value)
    with torch.no_grad():
        assert grouped(x, SPLITS[0]).shape == (x.shape[0], OUT)


@pytest.mark.parametrize(
    ("m_splits", "error", "match"),
    [
        ([3, 5, 0, 1], ValueError, r"m_splits.*sums to 9.*x has 10 rows"),
        ([5, 5], ValueError, r"m_splits.*2 entries.*one per expert \(4\)"),
        ([5, 6, -1, 0], ValueError, r"m_splits.*>= 0"),
        ([5, 5.0, 0, 0], TypeError, r"m_splits.*element 1 is 5\.0 \(float\)"),
        ([5, True, 4, 0], TypeError, r"m_splits.*element 1 is True \(bool\)"),
        ("5500", TypeError, r"m_splits.*got str"),
        (7, TypeError, r"m_splits.*got int"),
        (torch.tensor([5.0, 5.0, 0.0, 0.0]), TypeError, r"m_splits.*dtype torch\.float32"),
        (torch.tensor([[5, 5, 0, 0]]), ValueError, r"m_splits.*1-D"),
        (torch.empty(4, dtype=torch.int64, device="meta"), TypeError, r"on meta.*host sync"),
    ],
)
def test_m_splits_validation(m_splits, error, match):
    grouped, _ = _pair(fuse=False)
    with pytest.raises(error, match=match):
        grouped(torch.randn(10, IN), m_splits)


def test_m_splits_accepted_forms_and_x_validation():
    grouped, _ = _pair(fuse=False)
    x = torch.randn(10, IN)
    expected = grouped(x, [3, 5, 0, 2])
    for splits in ((3, 5, 0, 2), torch.tensor([3, 5, 0, 2]), torch.tensor([3, 5, 0, 2]).int()):
        assert torch.equal(grouped(x, splits), expected)
    with pytest.raises(ValueError, match=r"x.*\[tokens, 16\].*\(2, 5, 16\)"):
        grouped(torch.randn(2, 5, IN), [10, 0, 0, 0])
    with pytest.raises(TypeError, match=r"x.*must be a torch\.Tensor"):
        grouped([[1.0] * IN], [1, 0, 0, 0])
    with pytest.raises(TypeError, match="num_experts"):
        GroupedLinear(2.0, 4, 4)
    with pytest.raises(ValueError, match="in_features"):
        GroupedLinear(2, 0, 4)


def test_offloading_on_and_off_gives_bitwise_equal_main_grads():
    def build():
        torch.manual_seed(0)
        return nn.ModuleList(
            [GroupedLinear(E, IN, IN, fuse_wgrad_accumulation=True) for _ in range(3)]
        )

    def forward(layers, x, splits):
        h = x
        for layer in layers:
            h = torch.tanh(layer(h, splits))
        return _loss(h)

    def run(layers, offloader):
        offload.main_grad.attach(layers)
        for x, splits in zip(_inputs(), SPLITS, strict=True):
            if offloader is None:
                loss = forward(layers, x, splits)
            else:
                with offloader:
                    loss = forward(layers, x, splits)
            loss.backward()
        return [p.main_grad.clone() for p in layers.parameters() if p.dim() == 2]

    plain = run(build(), None)
    layers = build()
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    try:
        offloaded = run(layers, off)
        assert off.stats.bytes_offloaded > 0
    finally:
        off.close()
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
def test_cuda_grouped_fused_fp32_main_grad():
    """bf16 experts, fp32 main_grad on the GPU: per-expert fused GEMMs, empty expert intact.

    Reference: per-expert dY_i^T X_i in fp64 from the same bf16 operands; fp32
    accumulation error only (1e-4 of the largest entry), see test_nn_linear.py.
    """
    dev = torch.device("cuda")
    torch.manual_seed(0)
    grouped = GroupedLinear(
        E, 256, 384, device=dev, dtype=torch.bfloat16, fuse_wgrad_accumulation=True
    )
    offload.main_grad.attach(grouped)
    grouped.weight2.main_grad.fill_(3.0)
    expected = [torch.zeros(384, 256, dtype=torch.float64, device=dev) for _ in range(E)]
    for splits in ([64, 100, 0, 36], [0, 50, 0, 150], [70, 10, 0, 20]):
        x = torch.randn(sum(splits), 256, device=dev, dtype=torch.bfloat16)
        grads = []
        y = grouped(x, splits)
        y.register_hook(grads.append)
        _loss(y).backward()
        for i, (g, xi) in enumerate(zip(grads[0].split(splits), x.split(splits), strict=True)):
            expected[i] += g.double().t() @ xi.double()
    for i in range(E):
        w = getattr(grouped, f"weight{i}")
        assert w.grad is None
        if i == 2:
            assert torch.equal(w.main_grad, torch.full_like(w.main_grad, 3.0))
            continue
        err = (w.main_grad.double() - expected[i]).abs().max()
        assert err <= 1e-4 * expected[i].abs().max(), (i, float(err))
