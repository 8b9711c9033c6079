"""Compressed offload (``compress="fp8"``) through the scheduler, on the CPU path.

The codec itself (block layout, the error bound, non-finite values) is tested in
``tests/core/test_compress_codec.py``; here: what the offloader sends compressed and what
exactly, every layout coming back with its dtype, shape and strides, the stats, the
config errors, and that ``compress=None`` stays bitwise equal to no offloading.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offload
from offload._core import _compress
from offload._core._runtime import Runtime
from offload.activations._handles import unpack_hook
from offload.activations._schedule import make_plan
from offload.activations._step import Step
from offload.config import OffloadConfig
from tests import models
from tests.models import assert_same, step, twin

#: Unit roundoff ``u`` and half the subnormal spacing ``eta`` of the cast back to each
#: dtype (the terms of the bound stated in ``offload/_core/_compress.py``).
_CAST = {
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float16: (2.0**-11, 2.0**-25),
    torch.float32: (0.0, 0.0),
}


def _bound(x: torch.Tensor) -> torch.Tensor:
    """The codec's stated per-element bound with the largest magnitude of the storage
    behind ``x`` as every block's amax (a block's is at most that, and the bound grows
    with the scale: a looser, still valid bound)."""
    base = x if x._base is None else x._base
    amax = float(base.float().abs().max())
    s = max(amax / 448.0, 2.0**-126)
    u, eta = _CAST[x.dtype]
    a = x.double().abs()
    return (1 + u) * ((2.0**-4 + 2.0**-22) * a + (2.0**-10 + 2.0**-23) * s) + u * a + eta


def _round_trip(
    tensors: list[torch.Tensor], *, expect_offload: bool = True, **cfg
) -> tuple[list[torch.Tensor], Step]:
    """Pack ``tensors`` in one offloaded group, finish the forward, unpack them all."""
    runtime = Runtime(OffloadConfig(min_tensor_bytes=0, compress="fp8", **cfg))
    st = Step(runtime, make_plan(2, [0], None))
    st.open_group(None)
    handles = [st.pack(t) for t in tensors]
    st.close_group()
    st.open_group(None)
    st.close_group()
    st.finish_forward()
    out = [unpack_hook(h) for h in reversed(handles)][::-1]
    stats = st.read_stats()
    del handles
    runtime.close()
    assert (stats.bytes_offloaded > 0) == expect_offload
    return out, st


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_layout_returns_dtype_shape_strides_within_bound(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = torch.randn(64, 200) * torch.logspace(-3, 3, 200)  # a wide range per row
    cases = {
        "contiguous": base.to(dtype),
        "transposed": base.to(dtype).t(),
        "offset slice": base.to(dtype)[10:50, 3:197],
        "ragged 1-D": torch.randn(1000 + 37).to(dtype),
        "3-D permuted": torch.randn(4, 6, 130).to(dtype).permute(2, 0, 1),
    }
    out, st = _round_trip(list(cases.values()), compress_filter=lambda t: True)
    assert st.stats.compress_bytes_before > 0
    for (name, t), got in zip(cases.items(), out):
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert got.stride() == t.stride(), name
        assert got.data_ptr() != t.data_ptr(), f"{name}: not offloaded"
        err = (got.double() - t.double()).abs()
        bound = _bound(t)
        assert bool((err <= bound).all()), (name, float((err - bound).max()))
        assert not torch.equal(got, t) or t.numel() == 0, f"{name}: nothing was quantized?"


def test_exempt_kinds_travel_bit_exact() -> None:
    ints = torch.randint(-(2**40), 2**40, (3000,), dtype=torch.int64)
    bools = torch.rand(4096) > 0.5
    fp8 = torch.randn(4096).to(torch.float8_e4m3fn)
    floats = torch.randn(4096)
    exempt = torch.randn(4096)
    marker = exempt.data_ptr()
    out, st = _round_trip(
        [ints, bools, fp8, floats, exempt],
        compress_filter=lambda t: t.data_ptr() != marker,
    )
    assert torch.equal(out[0], ints) and torch.equal(out[1], bools)
    assert torch.equal(out[2].view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(out[4], exempt)  # compress_filter said no: exact
    assert not torch.equal(out[3], floats)  # compressed
    by = st.stats.bytes_by_dtype
    assert by["int64"] == ints.nbytes and by["bool"] == bools.nbytes
    assert by["float8_e4m3fn"] == fp8.nbytes and by["float32"] == exempt.nbytes
    assert by["float32 as fp8"] == _compress.packed_nbytes(floats.numel())
    assert st.stats.compress_bytes_before == floats.nbytes
    assert st.stats.compress_bytes_after == _compress.packed_nbytes(floats.numel())


def test_default_sends_fp32_exactly_and_compresses_half_precision() -> None:
    fp32, bf16, fp16 = torch.randn(4096), torch.randn(4096).bfloat16(), torch.randn(4096).half()
    out, st = _round_trip([fp32, bf16, fp16])
    assert torch.equal(out[0], fp32)
    assert not torch.equal(out[1], bf16) and not torch.equal(out[2], fp16)
    by = st.stats.bytes_by_dtype
    assert by["float32"] == fp32.nbytes
    assert by["bfloat16 as fp8"] == by["float16 as fp8"] == _compress.packed_nbytes(4096)


def test_zero_element_tensors_are_kept() -> None:
    empty = torch.randn(0, 128)
    out, st = _round_trip([empty], expect_offload=False)
    assert out[0].shape == (0, 128)
    assert st.stats.compress_bytes_before == 0


def _bf16_layers(n: int = 4) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(models.LlamaBlock(64, 4, 128) for _ in range(n)).to(torch.bfloat16)


def test_model_gradients_close_and_half_the_bytes() -> None:
    layers = _bf16_layers()
    x = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    ref = step(layers, x, models.run_plain)
    plain = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    exact = step(layers, x, models.run_plain, plain)
    assert_same(ref, exact)  # compress=None: bitwise, as always
    packed = offload.ActivationOffloader(
        layers, offload_layers="all", min_tensor_bytes=0, compress="fp8"
    )
    lossy = step(layers, x, models.run_plain, packed)
    stats = packed.stats
    assert stats.compress_bytes_before > 0
    ratio = stats.compress_bytes_after / stats.compress_bytes_before
    assert 0.5 < ratio < 0.52  # bf16 -> 1 byte per element + 4 bytes per 128
    # same bytes chosen as without compression; fewer of them crossed the link
    assert stats.bytes_offloaded < plain.stats.bytes_offloaded
    assert f"ratio {ratio:.2f}" in stats.summary()
    for g_ref, g in zip(ref[1], lossy[1]):
        cos = torch.nn.functional.cosine_similarity(
            g_ref.float().flatten(), g.float().flatten(), dim=0
        )
        assert cos > 0.99, float(cos)
    assert not all(torch.equal(a, b) for a, b in zip(ref[1], lossy[1]))


def test_filter_that_exempts_everything_is_bitwise() -> None:
    layers = _bf16_layers(3)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    ref = step(twin(layers), x, models.run_plain)
    off = offload.ActivationOffloader(
        layers,
        offload_layers="all",
        min_tensor_bytes=0,
        compress="fp8",
        compress_filter=lambda t: False,
    )
    got = step(layers, x, models.run_plain, off)
    assert_same(ref, got)
    assert off.stats.bytes_offloaded > 0 and off.stats.compress_bytes_before == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"compress": "int8"}, ValueError, "compress='int8'.*accepted values: None"),
        ({"compress": True}, ValueError, "compress=True"),
        ({"compress": "fp8", "compress_filter": 3}, TypeError, "compress_filter must be"),
        ({"compress_filter": lambda t: True}, ValueError, "compress=None"),
    ],
)
def test_config_errors_name_the_argument(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        OffloadConfig(**kwargs)
    with pytest.raises(error, match=match):
        offload.ActivationOffloader([nn.Linear(2, 2), nn.Linear(2, 2)], **kwargs)


def test_large_spans_travel_in_chunks(monkeypatch) -> None:
    """Spans longer than ``_device.CHUNK_ELEMENTS`` are packed chunk by chunk (the CUDA
    backend's staging slots hold one chunk): the same bytes on the host, the same bound."""
    from offload._core import _device

    monkeypatch.setattr(_device, "CHUNK_ELEMENTS", 256)
    torch.manual_seed(0)
    t = torch.randn(4 * 256 + 77) * torch.logspace(-2, 2, 4 * 256 + 77)
    out, st = _round_trip([t], compress_filter=lambda t: True)
    assert st.stats.compress_bytes_after == _compress.packed_nbytes(t.numel())
    assert bool(((out[0].double() - t.double()).abs() <= _bound(t)).all())
    # every chunk has its own scales: a chunk of tiny values keeps its precision
    small = t[:256].abs().max() / 448
    assert float((out[0][:256] - t[:256]).abs().max()) <= 2.0**-4 * float(
        t[:256].abs().max()
    ) + float(small)


def test_fp8_on_a_float32_model_warns_once_naming_compress_and_the_dtypes() -> None:
    """compress="fp8" on fp32 layers compresses nothing: one warning says so at the
    first forward, naming the argument and the dtypes it compresses."""
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64, 4, 128) for _ in range(3))
    x = torch.randn(2, 32, 64)
    off = offload.ActivationOffloader(
        layers, offload_layers="all", min_tensor_bytes=0, compress="fp8"
    )
    with pytest.warns(UserWarning, match=r"compress='fp8' compressed nothing") as record:
        step(layers, x, models.run_plain, off)
    text = str(record[0].message)
    assert "bfloat16 and float16" in text and "float32" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        step(layers, x, models.run_plain, off)
    assert off.stats.bytes_offloaded > 0 and off.stats.compress_bytes_before == 0
    off.close()
    # bf16 layers compress: no warning
    bf16 = _bf16_layers(3)
    packed = offload.ActivationOffloader(
        bf16, offload_layers="all", min_tensor_bytes=0, compress="fp8"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(bf16, x.bfloat16(), models.run_plain, packed)
    assert packed.stats.compress_bytes_before > 0
    packed.close()
