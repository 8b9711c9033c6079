"""Every kind of saved tensor round-trips exactly, or stays on the device with its reason
(docs/design.md 4.5, 4.7, 4.8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

import offload
from tests import models
from tests.models import assert_same, twin


class SaveAll(torch.autograd.Function):
    """Saves arbitrary tensors; backward checks that each comes back identical."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.expected = [
            (t.detach().clone(), t.dtype, t.shape, None if t.is_sparse else t.stride())
            for t in tensors
        ]
        return x * 1

    @staticmethod
    def backward(ctx, g):
        got = ctx.saved_tensors
        for t, (want, dtype, shape, stride) in zip(got, ctx.expected):
            assert t.dtype == dtype and t.shape == shape, (t.dtype, dtype, t.shape, shape)
            assert t.is_sparse or t.stride() == stride, (t.stride(), stride)
            if t.is_sparse:
                t, want = t.to_dense(), want.to_dense()
            a, b = (
                (t.view(torch.uint8), want.view(torch.uint8))
                if dtype.itemsize == 1 and dtype.is_floating_point
                else (t, want)
            )
            assert torch.equal(a, b)
        ctx.checked = True
        return (g, *([None] * len(got)))


class Saver(nn.Module):
    """A layer that saves whatever ``make(x)`` returns."""

    def __init__(self, make):
        super().__init__()
        self.make = make
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return SaveAll.apply(x * self.w, *self.make(x))


XW = 64 * 64 * 4  # the activation x * w that every Saver layer also saves


def run_savers(make, n: int = 2, min_bytes: int = 0, x=None):
    layers = nn.ModuleList(Saver(make) for _ in range(n))
    off = offload.ActivationOffloader(layers, offload_layers=n - 1, min_tensor_bytes=min_bytes)
    x = torch.randn(64, 64, requires_grad=True) if x is None else x
    with off:
        y = x
        for layer in layers:
            y = layer(y)
    y.sum().backward()
    return off.stats


def _base():
    torch.manual_seed(0)
    return torch.randn(256, 128)


KINDS = {
    "contiguous": lambda: [_base()],
    "transposed": lambda: [_base().t()],
    "sliced": lambda: [_base()[3:200:2, 5:77]],
    "expanded": lambda: [torch.randn(1, 128).expand(256, 128)],
    "zero_element": lambda: [torch.randn(0, 128)],
    "channels_last": lambda: [torch.randn(4, 8, 16, 16).to(memory_format=torch.channels_last)],
    "float8_e4m3fn": lambda: [_base().to(torch.float8_e4m3fn)],
    "float8_e5m2": lambda: [_base().to(torch.float8_e5m2)],
    "bool": lambda: [_base() > 0],
    "int64": lambda: [torch.randint(-(2**40), 2**40, (256, 128))],
    "complex64": lambda: [torch.randn(256, 128, dtype=torch.complex64)],
    "bfloat16": lambda: [_base().bfloat16()[:, 1:]],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_exact(kind: str) -> None:
    made = {}

    def make(x):
        made.setdefault("t", KINDS[kind]())
        return made["t"]

    stats = run_savers(make)
    t = made["t"][0]
    if t.numel() == 0:
        assert stats.layers[0].bytes_offloaded == XW  # only x * w: nothing to copy
        return
    assert stats.layers[0].bytes_offloaded > XW
    name = str(t.dtype).removeprefix("torch.")
    assert stats.bytes_by_dtype[name] > 0
    if kind.startswith("float8"):
        # FP8 payloads count one byte per element; both layers save the same tensor,
        # and only the first layer is offloaded
        assert stats.bytes_by_dtype[name] == t.numel()


def test_three_views_of_one_storage_move_once() -> None:
    base = torch.randn(64, 1024)

    def make(x):
        return [base[:, :512], base.t(), base[10:20]]

    stats = run_savers(make)
    assert stats.layers[0].bytes_offloaded == base.numel() * 4 + XW  # + x * w


def test_storage_saved_by_four_groups_moves_once() -> None:
    table = torch.randn(512, 256)  # a RoPE table / mask made once, passed to every layer

    def make(x):
        return [table]

    stats = run_savers(make, n=5)
    nbytes = table.numel() * 4
    assert stats.layers[0].bytes_offloaded == nbytes + XW
    for la in stats.layers[1:4]:
        assert la.bytes_offloaded == XW  # only its own x * w
        assert la.bytes_kept["shared"] == nbytes
    assert stats.bytes_kept["shared"] == 3 * nbytes
    assert stats.bytes_reloaded == stats.bytes_offloaded  # and comes back once


def test_autocast_sends_only_activation_bytes() -> None:
    """fp32 weights under bf16 autocast: F.linear saves weight.to(bf16).t(), which is
    the parameter's data, not an activation (4.7)."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x):
            return F.gelu(self.fc(x))

    torch.manual_seed(0)
    layers = nn.ModuleList(Block() for _ in range(4))
    ref = twin(layers)
    n = 128

    def go(ls, off):
        x = torch.randn(n, 256, generator=torch.Generator().manual_seed(3))
        for p in ls.parameters():
            p.grad = None
        with off if off is not None else models.contextlib.nullcontext():
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                y = models.run_plain(ls, x)
        y.float().square().mean().backward()
        return [p.grad.clone() for p in ls.parameters()]

    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    got = go(layers, off)
    want = go(ref, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    stats = off.stats
    act = n * 256 * 2  # bf16
    # per offloaded layer: the linear's bf16 input and the gelu's bf16 input
    assert [la.bytes_offloaded for la in stats.layers] == [2 * act] * 3 + [0]
    assert stats.bytes_by_dtype == {"bfloat16": 6 * act}
    # layer 0 needs no input gradient, so it saves no weight; the others save the cast
    # (the last layer is not offloaded: it runs without the offloader's hooks, so what
    # it saves is not seen, not counted)
    assert [la.bytes_kept["parameter"] for la in stats.layers] == [0] + [256 * 256 * 2] * 2 + [0]
    assert stats.layers[3].bytes_kept["not_selected"] == 0


# ---- wrapper subclasses ---------------------------------------------------------------


class ScaledFP8(torch.Tensor):
    """float8 data plus a scale: how DeepSeek-V3 caches MoE inputs for backward."""

    @staticmethod
    def __new__(cls, data, scale, dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data, scale, dtype):
        self._data = data
        self._scale = scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return ScaledFP8(inner["_data"], inner["_scale"], ctx["dtype"])

    def dequantize(self):
        return self._data.to(self.dtype) * self._scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            (t,) = args
            return ScaledFP8(t._data, t._scale, t.dtype)

        def unwrap(x):
            return x.dequantize() if isinstance(x, ScaledFP8) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    @staticmethod
    def quantize(x):
        scale = x.abs().amax().clamp(min=1e-12) / 448.0
        return ScaledFP8((x / scale).to(torch.float8_e4m3fn), scale.reshape(()), x.dtype)


class FP8CachedLinear(torch.autograd.Function):
    """y = x @ w.T, caching x in FP8 for the weight gradient."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(ScaledFP8.quantize(x.detach()), w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        xq, w = ctx.saved_tensors
        assert isinstance(xq, ScaledFP8)
        return g @ w, g.t() @ xq.dequantize()


class FP8Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        return torch.tanh(FP8CachedLinear.apply(x, self.w))


def test_scaled_fp8_subclass_offloads_one_byte_per_element() -> None:
    torch.manual_seed(0)
    dim, n = 128, 256
    layers = nn.ModuleList(FP8Block(dim) for _ in range(3))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    x = torch.randn(n, dim)
    got = models.step(layers, x, models.run_plain, off)
    assert_same(got, models.step(ref, x, models.run_plain))
    stats = off.stats
    assert stats.bytes_by_dtype["float8_e4m3fn"] == 2 * n * dim  # 1 byte/element, 2 layers
    assert stats.layers[0].bytes_kept["small"] > 0  # the scale stays on the device
    assert stats.layers[0].bytes_kept["parameter"] == dim * dim * 4


# ---- TransformerEngine's quantized-tensor protocol -------------------------------------


class FakeTEQuantized(torch.Tensor):
    """Implements only what TE >= 2.0's offloading relies on: ``prepare_for_saving()``
    returns ``(tensors, obj)`` and empties ``obj``; ``restore_from_saved(tensors)``
    refills it and returns what it did not consume. (TransformerEngine itself cannot be
    installed here; this checks our side of the protocol, not TE.)"""

    @staticmethod
    def __new__(cls, data, scale_inv, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)

    def __init__(self, data, scale_inv, dtype):
        self._data = data
        self._scale_inv = scale_inv

    def prepare_for_saving(self):
        tensors = [self._data, None, self._scale_inv]
        self._data = self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self._data, _, self._scale_inv = tensors[:3]
        return tensors[3:]

    def dequantize(self):
        return self._data.to(self.dtype) * self._scale_inv

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            (t,) = args
            return FakeTEQuantized(t._data, t._scale_inv, t.dtype)
        raise NotImplementedError(func)


class TECached(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q):
        ctx.save_for_backward(q)
        ctx.q_obj = q
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (q,) = ctx.saved_tensors
        ctx.seen = q.dequantize()
        return g, None


def test_te_quantized_protocol_round_trip_without_mutating_input() -> None:
    data = torch.randn(256, 256).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.5)
    q = FakeTEQuantized(data, scale, torch.float32)
    seen = {}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            y = TECached.apply(x * self.w, q)
            seen["fn"] = y.grad_fn
            return y

    layers = nn.ModuleList([Block(), Block()])
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=1024)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        out = layers[0](x)
        fn = seen["fn"]
        out = layers[1](out)
    # the hook's input was not emptied
    assert q._data is data and q._scale_inv is scale
    out.sum().backward()
    assert torch.equal(fn.seen, data.to(torch.float32) * 0.5)
    stats = off.stats
    assert stats.bytes_by_dtype["float8_e4m3fn"] == 256 * 256
    assert stats.layers[0].bytes_kept["small"] >= 4  # the scale stays


def test_do_not_offload_marks_are_honoured() -> None:
    marked = torch.randn(256, 256)
    marked._TE_do_not_offload = True
    stats = run_savers(lambda x: [marked])
    assert stats.layers[0].bytes_kept["opted_out"] == 256 * 256 * 4
    weight_like = torch.randn(256, 256)
    weight_like.is_weight = True
    stats = run_savers(lambda x: [weight_like])
    assert stats.layers[0].bytes_kept["parameter"] == 256 * 256 * 4 + 4  # + the scalar w


def test_sparse_and_nested_are_kept_as_unsupported() -> None:
    sparse = torch.randn(64, 64).to_sparse()
    stats = run_savers(lambda x: [sparse])
    assert stats.layers[0].bytes_offloaded == XW  # only x * w
    # kept tensors count numel * itemsize (its dense size, for a sparse tensor)
    assert stats.layers[0].bytes_kept["unsupported"] == 64 * 64 * 4
