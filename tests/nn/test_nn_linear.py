"""offload.nn.Linear: fused weight-gradient accumulation into main_grad (docs/design.md 4.9).

Tolerances. On the CPU, fp32 weights with an fp32 ``main_grad`` use one fused
``main_grad.addmm_(dY^T, X, beta=1)``: the GEMM may add ``main_grad`` into its partial
sums at another point than "dW, then +=" does (BLAS K-blocking), so the accumulated
result agrees with the sum of the reference ``.grad``s to fp32 rounding, not bitwise:
``rtol=1e-5, atol=1e-6`` on values of order 1 (a few ulps of the largest partial sum of
a 3 x 24-row reduction). Overwrite mode (beta = 0) is one GEMM per micro-batch like the
reference's and is compared with the same tolerance; input gradients are computed like
nn.Linear's and are compared the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import offload
from offload.nn import Linear

RTOL, ATOL = 1e-5, 1e-6
IN, OUT = 32, 24


def _pair(bias: bool = True, dtype: torch.dtype = torch.float32) -> tuple[Linear, nn.Linear]:
    torch.manual_seed(0)
    fused = Linear(IN, OUT, bias=bias, dtype=dtype, fuse_wgrad_accumulation=True)
    ref = nn.Linear(IN, OUT, bias=bias, dtype=dtype)
    ref.load_state_dict(fused.state_dict())
    return fused, ref


def _batches(n: int = 3, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4 + i, IN, generator=g).to(dtype) for i in range(n)]


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sin().sum()


def test_same_init_parameters_and_state_dict_as_nn_linear():
    torch.manual_seed(3)
    a = Linear(IN, OUT, fuse_wgrad_accumulation=True)
    torch.manual_seed(3)
    b = nn.Linear(IN, OUT)
    assert isinstance(a, nn.Linear)
    assert list(a.state_dict()) == list(b.state_dict()) == ["weight", "bias"]
    for k in b.state_dict():
        assert torch.equal(a.state_dict()[k], b.state_dict()[k])
    assert "fuse_wgrad_accumulation=True" in repr(a)
    x = torch.randn(3, IN)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_unfused_is_nn_linear():
    torch.manual_seed(0)
    a = Linear(IN, OUT)
    b = nn.Linear(IN, OUT)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, IN)
    _loss(a(x)).backward()
    _loss(b(x)).backward()
    assert torch.equal(a.weight.grad, b.weight.grad)
    assert torch.equal(a.bias.grad, b.bias.grad)


@pytest.mark.parametrize("bias", [True, False])
def test_accumulate_three_micro_batches(bias):
    fused, ref = _pair(bias)
    offload.main_grad.attach(fused)
    expected = torch.zeros(OUT, IN)
    expected_bias = torch.zeros(OUT)
    for x in _batches():
        xf = x.clone().requires_grad_()
        xr = x.clone().requires_grad_()
        _loss(fused(xf)).backward()
        _loss(ref(xr)).backward()
        torch.testing.assert_close(xf.grad, xr.grad, rtol=RTOL, atol=ATOL)
        expected += ref.weight.grad
        ref.weight.grad = None
        if bias:
            expected_bias += ref.bias.grad
            ref.bias.grad = None
    assert fused.weight.grad is None  # fused: no .grad
    torch.testing.assert_close(fused.weight.main_grad, expected, rtol=RTOL, atol=ATOL)
    if bias:  # the bias is not fused: .grad, accumulated by autograd
        torch.testing.assert_close(fused.bias.grad, expected_bias, rtol=RTOL, atol=ATOL)
        assert torch.equal(fused.bias.main_grad, torch.zeros(OUT))


def test_overwrite_mode_keeps_last_micro_batch():
    fused, ref = _pair()
    offload.main_grad.attach(fused)
    fused.weight.overwrite_main_grad = True
    fused.weight.main_grad.fill_(float("nan"))  # beta = 0 must ignore old contents
    for x in _batches():
        _loss(fused(x)).backward()
        ref.weight.grad = None
        _loss(ref(x)).backward()
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight.main_grad, ref.weight.grad, rtol=RTOL, atol=ATOL)


def test_grad_added_to_main_grad_returns_dummy():
    fused, ref = _pair()
    offload.main_grad.attach(fused)
    fused.weight.grad_added_to_main_grad = False
    seen = []
    fused.weight.register_hook(seen.append)  # runs before AccumulateGrad: sees the dummy
    x = _batches(1)[0]
    _loss(fused(x)).backward()
    _loss(ref(x)).backward()
    assert fused.weight.grad_added_to_main_grad is True
    (dummy,) = seen
    assert dummy.shape == fused.weight.shape and dummy.dtype == fused.weight.dtype
    assert dummy.stride() == (0, 0)  # an expanded 0-d tensor: nothing full-size allocated
    assert dummy.untyped_storage().nbytes() == dummy.element_size()
    assert not dummy.any()
    torch.testing.assert_close(fused.weight.main_grad, ref.weight.grad, rtol=RTOL, atol=ATOL)
    # the DDP-style hook consumed it; to_grads adds the (zero) .grad: nothing changes
    offload.main_grad.to_grads(fused)
    torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=RTOL, atol=ATOL)


def test_missing_main_grad_names_attach():
    fused, _ = _pair()
    with pytest.raises(RuntimeError, match=r"offload\.main_grad\.attach"):
        fused(torch.randn(2, IN))
    # without gradients (evaluation) nothing is needed
    with torch.no_grad():
        assert fused(torch.randn(2, IN)).shape == (2, OUT)
    # also when main_grad disappears between forward and backward
    offload.main_grad.attach(fused)
    y = fused(torch.randn(2, IN))
    del fused.weight.main_grad
    with pytest.raises(RuntimeError, match=r"offload\.main_grad\.attach"):
        y.sum().backward()


def test_bad_arguments():
    with pytest.raises(TypeError, match="fuse_wgrad_accumulation"):
        Linear(4, 4, fuse_wgrad_accumulation=1)
    fused, _ = _pair()
    fused.weight.main_grad = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="main_grad has shape"):
        fused(torch.randn(2, IN))


def test_inplace_weight_update_between_forward_and_backward_is_caught():
    fused, _ = _pair()
    offload.main_grad.attach(fused)
    y = fused(torch.randn(2, IN, requires_grad=True))
    with torch.no_grad():
        fused.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_weight_is_not_a_saved_tensor():
    """Only the input goes through saved-tensor hooks; the Parameter is held weakly."""
    fused, _ = _pair()
    offload.main_grad.attach(fused)
    packed = []

    def pack(t):
        packed.append(t)
        return t.detach().clone()  # what an offloader gives back: a plain tensor

    x = torch.randn(3, IN, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused(x)
    assert len(packed) == 1 and packed[0].shape == x.shape
    assert not any(isinstance(t, nn.Parameter) for t in packed)
    y.sum().backward()
    assert fused.weight.main_grad.abs().sum() > 0


class _RecordOutputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape), t.dtype))
        return out


def test_cpu_bf16_fallback_matches_reference_grads():
    """bf16 weights, fp32 main_grad on the CPU: dW in bf16 (like .grad), added in fp32."""
    fused, ref = _pair(dtype=torch.bfloat16)
    offload.main_grad.attach(fused)
    expected = torch.zeros(OUT, IN)
    for x in _batches(dtype=torch.bfloat16):
        _loss(fused(x)).backward()
        _loss(ref(x)).backward()
        expected += ref.weight.grad.float()
        ref.weight.grad = None
    assert fused.weight.main_grad.dtype == torch.float32
    # the same bf16 dW as autograd's .grad, added in fp32 (bitwise equal with this torch);
    # allowed: one bf16 ulp (2**-7 relative) per dW, in case a BLAS rounds the bf16 GEMM
    # with another operand layout than autograd's
    torch.testing.assert_close(fused.weight.main_grad, expected, rtol=2**-7, atol=1e-3)


def test_fp32_path_is_one_gemm_into_main_grad():
    """fp32 weight and main_grad: no [out, in] temporary is created in backward."""
    fused, _ = _pair()
    offload.main_grad.attach(fused)
    y = _loss(fused(torch.randn(6, IN, requires_grad=True)))
    with _RecordOutputs() as rec:
        y.backward()
    full = [o for o in rec.outputs if o[1] == (OUT, IN)]
    assert [f for f, _, _ in full] == ["aten.addmm_.default"], full


def test_offloading_on_and_off_gives_bitwise_equal_main_grads():
    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        return nn.ModuleList([Linear(IN, IN, fuse_wgrad_accumulation=True) for _ in range(4)])

    def run(layers, offloader):
        offload.main_grad.attach(layers)
        for x in _batches():
            x = x.reshape(-1, IN)
            if offloader is None:
                h = x
                for layer in layers:
                    h = torch.tanh(layer(h))
                loss = _loss(h)
            else:
                with offloader:
                    h = x
                    for layer in layers:
                        h = torch.tanh(layer(h))
                    loss = _loss(h)
            loss.backward()
        return [layer.weight.main_grad.clone() for layer in layers]

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


def test_autocast_matches_nn_linear():
    fused, ref = _pair()
    offload.main_grad.attach(fused)
    x = torch.randn(8, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yf = fused(x)
        yr = ref(x)
    assert yf.dtype == yr.dtype == torch.bfloat16
    assert torch.equal(yf, yr)
    _loss(yf).backward()
    _loss(yr).backward()
    # both compute dW from the same bf16 operands and round it to bf16 (ref: cast back to
    # fp32 for .grad; fused: added into fp32 main_grad): one bf16 ulp allowed, as above
    torch.testing.assert_close(fused.weight.main_grad, ref.weight.grad, rtol=2**-7, atol=1e-3)


# ---- GPU: the fused fp32-output GEMM ---------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("overwrite", [False, True])
def test_cuda_bf16_weight_fp32_main_grad_is_fused(overwrite):
    """bf16 weight, fp32 main_grad: one GEMM with fp32 output and beta, no bf16 dW.

    Reference: dY^T X summed over micro-batches in fp64 from the same bf16 operands. The
    fused GEMM multiplies bf16 values exactly and accumulates in fp32, so it is within
    fp32 accumulation error (1e-4 of the largest entry, for K <= 3 x 512 rows); a dW
    rounded to bf16 on the way (the unfused path) would be off by up to 2**-9 relative.
    """
    from offload.nn._wgrad import wgrad_mode

    dev = torch.device("cuda")
    assert wgrad_mode(dev, torch.bfloat16, torch.float32) in ("addmm", "baddbmm")
    torch.manual_seed(0)
    layer = Linear(1024, 768, device=dev, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    offload.main_grad.attach(layer)
    layer.weight.overwrite_main_grad = overwrite
    layer.weight.main_grad.fill_(float("nan") if overwrite else 0.0)
    expected = torch.zeros(768, 1024, dtype=torch.float64, device=dev)
    for rows in (512, 384, 500):
        x = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)
        grads = []
        y = layer(x)
        y.register_hook(grads.append)
        loss = _loss(y)
        with _RecordOutputs() as rec:
            loss.backward()
        full = [o for o in rec.outputs if o[1] == (768, 1024)]
        assert full, "the dispatch mode saw no wgrad GEMM (not propagated to backward?)"
        assert all(dtype == torch.float32 for _, _, dtype in full), full
        assert not any("copy" in f or "_to_copy" in f for f, _, _ in full), full
        dw = grads[0].double().t() @ x.double()
        expected = dw if overwrite else expected + dw
    assert layer.weight.grad is None
    err = (layer.weight.main_grad.double() - expected).abs().max()
    assert err <= 1e-4 * expected.abs().max(), float(err)


@pytest.mark.cuda
@needs_cuda
def test_cuda_offloading_on_and_off_bitwise_equal():
    dev = torch.device("cuda")

    def build():
        torch.manual_seed(0)
        return nn.ModuleList(
            [
                Linear(256, 256, device=dev, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
                for _ in range(4)
            ]
        )

    def run(layers, offloader):
        offload.main_grad.attach(layers)
        g = torch.Generator(device=dev).manual_seed(1)
        for _ in range(3):
            x = torch.randn(1024, 256, device=dev, dtype=torch.bfloat16, generator=g)
            ctx = (
                offloader
                if offloader is not None
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            )
            with ctx:
                h = x
                for layer in layers:
                    h = torch.tanh(layer(h))
                loss = _loss(h)
            loss.backward()
        torch.cuda.synchronize()
        return [layer.weight.main_grad.clone() for layer in layers]

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
