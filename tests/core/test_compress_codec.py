"""The blockwise FP8 codec of compressed offload (``offload._core._compress``).

CPU tests (CI): the packed layout against an independent NumPy reference of the module's
invariant (float64 arithmetic rounded once to float32, e4m3fn round-to-nearest-even from
the table of its 127 finite non-negative values), the stated error bound on several
distributions, zeros, non-finite blocks, argument errors.

GPU tests (``-m cuda``; skipped with a reason without a GPU, without triton, or on a GPU
without hardware fp8 conversion, compute capability below 8.9, which takes the eager
codec): the Triton kernels against the eager implementation on the same GPU and on the
CPU, bitwise (and, as a separate test, within the error bound, so a failure of the first
says whether the second still holds), the ragged tails, unaligned packed buffers, the
current stream, no allocation, no host synchronisation, offsets past 2**31. Run on the
GPU with
``PYTHONPATH=. python3 -m pytest -m cuda tests/core/test_compress_codec.py``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from offload._core import _compress as codec
from offload._core._compress import BLOCK, COMPRESSIBLE, packed_nbytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SIZES = [0, 1, 127, 128, 129, 1000, 4096 + 5]
KINDS = ["normal", "heavy", "tiny", "zeros", "mixed", "outlier"]
ROOT = Path(__file__).resolve().parents[2]


def on_cuda(fn):
    """Mark a test ``cuda`` and skip it, with a reason, on machines without a GPU."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn)
    return pytest.mark.cuda(fn)


# --------------------------------------------------------------------------------------
# data and the independent reference


def sample(kind: str, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``n`` values of ``dtype`` (on the CPU) from one of the test distributions."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    if kind == "normal":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "heavy":  # Cauchy, kept finite in the dtype
        u = torch.rand(n, generator=g, dtype=torch.float64)
        x = torch.tan(torch.pi * (u - 0.5)).clamp(-info.max / 4, info.max / 4)
    elif kind == "tiny":  # around the smallest normal: subnormals of the dtype and fp8's
        e = torch.rand(n, generator=g, dtype=torch.float64) * 16 - 12
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        x = sign * info.tiny * torch.exp2(e)
    elif kind == "zeros":  # every other block zero (one of them -0), the rest normal
        x = torch.randn(n, generator=g, dtype=torch.float64)
        blocks = torch.arange(n) // BLOCK
        x[blocks % 2 == 0] = 0.0
        x[blocks % 4 == 0] = -0.0
    elif kind == "mixed":  # both signs, magnitudes over the dtype's whole range per block
        lo = np.log2(info.smallest_normal) + np.log2(info.eps)  # smallest subnormal
        hi = np.log2(info.max) - 1
        e = lo + torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo)
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        x = sign * torch.exp2(e)
    elif kind == "outlier":  # normal with one value 1e3 larger per block
        x = torch.randn(n, generator=g, dtype=torch.float64)
        x[::BLOCK] *= 1e3
    else:
        raise AssertionError(kind)
    return x.to(dtype)


_E4M3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


def e4m3_rne(c: np.ndarray) -> np.ndarray:
    """float32 values with |c| <= 448 -> e4m3fn codes, round to nearest, ties to even."""
    a = np.abs(c.astype(np.float64))
    hi = np.clip(np.searchsorted(_E4M3, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = a - _E4M3[lo], _E4M3[hi] - a
    code = np.where(dhi < dlo, hi, np.where(dlo < dhi, lo, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == _E4M3[hi], hi, code)
    return (code | np.where(np.signbit(c), 0x80, 0)).astype(np.uint8)


def reference(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The module's invariant in NumPy: (float32 scales, uint8 codes) of ``x``.

    Each float32 operation is done in float64 and rounded once to float32, which is the
    correctly rounded float32 result for one division or one product of two floats.
    """
    n = x.numel()
    nb = -(-n // BLOCK)
    xs = np.zeros(nb * BLOCK, dtype=np.float32)
    xs[:n] = x.float().numpy()
    xs = xs.reshape(nb, BLOCK)
    finite = np.isfinite(xs)
    with np.errstate(all="ignore"):
        amax = np.abs(np.where(finite, xs, 0.0).astype(np.float64)).max(axis=1)
        scale = np.maximum((amax / 448.0).astype(np.float32), np.float32(2.0**-126))
        inv = (1.0 / scale.astype(np.float64)).astype(np.float32)
        y = (xs.astype(np.float64) * inv[:, None].astype(np.float64)).astype(np.float32)
    y = np.clip(np.where(finite, y, 0.0), -448.0, 448.0).astype(np.float32)
    codes = np.where(finite, e4m3_rne(y), np.uint8(0x7F)).astype(np.uint8).reshape(-1)[:n]
    return scale.astype(np.float32), codes


def reference_decode(scale: np.ndarray, codes: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32(q * scale), exact product rounded once, then cast to ``dtype``."""
    q = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).double().numpy()
    s = np.repeat(scale.astype(np.float64), BLOCK)[: codes.size]
    return torch.from_numpy((q * s).astype(np.float32)).to(dtype)


def encode(x: torch.Tensor) -> torch.Tensor:
    packed = torch.empty(packed_nbytes(x.numel()), dtype=torch.uint8, device=x.device)
    codec.quantize_into(x, packed)
    return packed


def decode(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    codec.dequantize_into(packed, out)
    return out


def split(packed: torch.Tensor, n: int) -> tuple[np.ndarray, np.ndarray]:
    nb = -(-n // BLOCK)
    raw = packed.cpu().numpy()
    return raw[: 4 * nb].copy().view(np.float32), raw[4 * nb :]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.cpu().view(view), b.cpu().view(view))


def same_decode(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that any NaN equals any NaN (payloads differ between devices:
    a GPU's ``0 * nan`` is the canonical NaN, a CPU keeps the operand's)."""
    a, b = a.cpu(), b.cpu()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and same_bits(a[~nan], b[~nan])


def check_bound(x: torch.Tensor, y: torch.Tensor, packed: torch.Tensor) -> float:
    """Assert the module's bound for every finite block; return max(error / bound)."""
    bound = codec.error_bound(x.cpu(), codec.unpack_scales(packed.cpu(), x.numel()))
    err = (y.cpu().double() - x.cpu().double()).abs()
    finite = torch.isfinite(bound)
    bad = finite & ~(err <= bound)
    assert not bad.any(), (
        f"{int(bad.sum())} elements exceed the bound; first at {int(bad.nonzero()[0])}: "
        f"x={x[bad][0].item()!r} y={y.cpu()[bad][0].item()!r} "
        f"err={err[bad][0].item():.3e} bound={bound[bad][0].item():.3e}"
    )
    if not finite.any():
        return 0.0
    ratio = err[finite] / bound[finite]
    return float(ratio.max())


# --------------------------------------------------------------------------------------
# CPU


def test_constants_and_packed_nbytes() -> None:
    assert BLOCK == 128
    assert frozenset({torch.bfloat16, torch.float16, torch.float32}) == COMPRESSIBLE
    assert [packed_nbytes(n) for n in (0, 1, 127, 128, 129, 1000, 4101)] == [
        0,
        5,
        131,
        132,
        137,
        1000 + 4 * 8,
        4101 + 4 * 33,
    ]
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="numel"):
            packed_nbytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_matches_reference(dtype: torch.dtype, n: int) -> None:
    x = sample("normal", n, dtype, seed=n) * 3
    packed = encode(x)
    assert packed.numel() == packed_nbytes(n)
    scale, codes = split(packed, n)
    want_scale, want_codes = reference(x)
    np.testing.assert_array_equal(scale.view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(codes, want_codes)
    y = decode(packed, x)
    assert same_bits(y, reference_decode(want_scale, want_codes, dtype))
    check_bound(x, y, packed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_bound_holds(dtype: torch.dtype, kind: str) -> None:
    n = 4 * 4096 + 77
    x = sample(kind, n, dtype, seed=KINDS.index(kind))
    packed = encode(x)
    scale, codes = split(packed, n)
    want_scale, want_codes = reference(x)
    np.testing.assert_array_equal(scale.view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(codes, want_codes)
    y = decode(packed, x)
    assert torch.isfinite(y).all()
    worst = check_bound(x, y, packed)
    if kind == "normal":  # the bound is nearly attained: it is not loose
        assert worst > 0.75, worst


def test_zeros_decode_exactly_with_their_sign() -> None:
    for dtype in DTYPES:
        x = torch.zeros(3 * BLOCK + 5, dtype=dtype)
        x[1::2] = -0.0
        x[BLOCK + 7] = 1.5  # one non-zero block next to zero blocks
        packed = encode(x)
        y = decode(packed, x)
        assert same_bits(y[x == 0], x[x == 0])  # -0 stays -0
        scales = codec.unpack_scales(packed, x.numel())
        assert scales[0] == scales[2] == scales[3] == 2.0**-126
        assert y[BLOCK + 7] == 1.5


def test_extremes_stay_finite() -> None:
    for dtype in DTYPES:
        info = torch.finfo(dtype)
        vals = [info.max, -info.max, info.max * 0.99, info.tiny, info.smallest_normal / 4]
        x = torch.tensor(vals * 30, dtype=torch.float64).to(dtype)
        x[-1] = torch.finfo(dtype).max
        y = decode(encode(x), x)
        assert torch.isfinite(y).all(), dtype
        check_bound(x, y, encode(x))
    # a block holding float32's largest value and nothing else of note
    x = torch.full((BLOCK,), torch.finfo(torch.float32).max)
    assert same_bits(decode(encode(x), x), x)


def test_non_finite_elements_decode_to_nan_alone() -> None:
    """An inf or NaN decodes to NaN and leaves its block's other elements as if it were
    0: a span's unrelated bytes can never turn the saved tensor's elements into NaN."""
    for dtype in DTYPES:
        n = 5 * BLOCK + 9
        x = sample("normal", n, dtype)
        bad = [BLOCK + 3, 2 * BLOCK + 127, 3 * BLOCK, n - 1]  # n - 1: the partial block
        x[bad[0]] = float("inf")
        x[bad[1]] = -float("inf")
        x[bad[2]] = float("nan")
        x[bad[3]] = float("nan")
        packed = encode(x)
        y = decode(packed, x)
        assert torch.isnan(y[bad]).all(), dtype
        good = torch.ones(n, dtype=torch.bool)
        good[bad] = False
        assert torch.isfinite(y[good]).all(), dtype
        assert torch.isfinite(codec.unpack_scales(packed, n)).all()
        assert (split(packed, n)[1][bad] == 0x7F).all()
        clean = x.clone()
        clean[bad] = 0
        y_clean = decode(encode(clean), clean)
        assert same_bits(y[good], y_clean[good]), dtype


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_unaligned_packed_buffer(offset: int) -> None:
    x = sample("normal", 1000, torch.bfloat16)
    want = encode(x)
    buf = torch.full((want.numel() + 8,), 0xAB, dtype=torch.uint8)
    packed = buf[offset : offset + want.numel()]
    codec.quantize_into(x, packed)
    assert torch.equal(packed, want)
    assert (buf[:offset] == 0xAB).all() and (buf[offset + want.numel() :] == 0xAB).all()
    assert torch.equal(decode(packed, x), decode(want, x))


def test_inputs_requiring_grad_and_cpu_path_without_triton(monkeypatch) -> None:
    def no_triton():
        raise AssertionError("the CPU path must not build Triton kernels")

    monkeypatch.setattr(codec, "_kernels", no_triton)
    x = torch.randn(300, requires_grad=True)
    packed = encode(x)
    y = decode(packed, x.detach())
    check_bound(x.detach(), y, packed)


_U8 = torch.uint8
_DATA = r"\(src=.*1-D contiguous tensor of dtype torch.bfloat16, torch.float16, torch.float32"
_PACKED = r"\(out=.*1-D contiguous torch.uint8 tensor of packed_nbytes\(10\) = 14 bytes"
BAD_QUANTIZE = [  # (src, out, the message expected)
    (lambda: torch.zeros(10, dtype=torch.int32), lambda n: torch.empty(n, dtype=_U8), _DATA),
    (lambda: torch.zeros(10, dtype=torch.float64), lambda n: torch.empty(n, dtype=_U8), _DATA),
    (lambda: torch.zeros(2, 5), lambda n: torch.empty(n, dtype=_U8), _DATA),
    (lambda: torch.zeros(20)[::2], lambda n: torch.empty(n, dtype=_U8), _DATA),
    (lambda: [0.0] * 10, lambda n: torch.empty(n, dtype=_U8), r"\(src=.*torch.Tensor"),
    (lambda: torch.zeros(10), lambda n: torch.empty(n + 1, dtype=_U8), _PACKED),
    (lambda: torch.zeros(10), lambda n: torch.empty(n, dtype=torch.int8), _PACKED),
    (lambda: torch.zeros(10), lambda n: torch.empty(2 * n, dtype=_U8)[::2], _PACKED),
    (lambda: torch.zeros(10), lambda n: [0] * n, r"\(out=.*torch.Tensor"),
    (
        lambda: torch.zeros(10),
        lambda n: torch.empty(n, dtype=_U8, device="meta"),
        r"\(out=.*on cpu \(the data's device\)",
    ),
]


@pytest.mark.parametrize(("make_src", "make_out", "message"), BAD_QUANTIZE)
def test_quantize_rejects_bad_arguments(make_src, make_out, message) -> None:
    src, out = make_src(), make_out(packed_nbytes(10))
    for fn in (codec.quantize_into, codec.quantize_eager):
        with pytest.raises(ValueError, match=message):
            fn(src, out)


def test_dequantize_rejects_bad_arguments() -> None:
    packed = encode(torch.randn(10))
    accepted = "torch.bfloat16, torch.float16, torch.float32"
    with pytest.raises(ValueError, match=rf"\(out=.*{accepted}"):
        codec.dequantize_into(packed, torch.empty(10, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"\(out=.*{accepted}"):
        codec.dequantize_into(packed, torch.empty(20)[::2])
    with pytest.raises(ValueError, match=r"\(packed=.*packed_nbytes\(11\) = 15"):
        codec.dequantize_into(packed, torch.empty(11))
    with pytest.raises(ValueError, match=r"\(packed=.*torch.uint8"):
        codec.dequantize_into(packed.view(torch.int8), torch.empty(10))
    with pytest.raises(ValueError, match=r"\(scales=.*one per block"):
        codec.error_bound(torch.randn(300), torch.ones(2))


_NO_TRITON_CHECK = """
import sys

attempts = []

class Refuse:  # records and refuses any import of triton (_kernels() would swallow a raise)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            attempts.append(name)
            raise ImportError("refused: " + name)
        return None

sys.meta_path.insert(0, Refuse())
import torch
from offload._core import _compress as c
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x = torch.randn(1000).to(dtype)
    packed = torch.empty(c.packed_nbytes(x.numel()), dtype=torch.uint8)
    c.quantize_into(x, packed)
    y = torch.empty_like(x)
    c.dequantize_into(packed, y)
    assert torch.isfinite(y).all()
assert not c.triton_supported("cpu")
assert not attempts, attempts
assert not any(m.split(".")[0] == "triton" for m in sys.modules)
print("ok")
"""


def test_cpu_path_never_imports_triton() -> None:
    """``quantize_into`` / ``dequantize_into`` on the CPU (and ``triton_supported("cpu")``)
    in a fresh process where importing ``triton`` raises."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _NO_TRITON_CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["ok"]


def test_triton_entry_points_refuse_devices_without_hardware_fp8(monkeypatch) -> None:
    """``quantize_triton`` / ``dequantize_triton`` raise, naming the requirement and the
    fallback, where the kernels would need an fp8 conversion the device lacks."""
    x = torch.randn(300)
    packed = encode(x)
    with pytest.raises(RuntimeError, match=r"compute capability 8\.9.*on cpu.*quantize_into"):
        codec.quantize_triton(x, packed)
    with pytest.raises(RuntimeError, match=r"compute capability 8\.9.*on cpu.*dequantize_into"):
        codec.dequantize_triton(packed, torch.empty_like(x))
    # an Ampere GPU (8.0): the message names its capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(codec, "_index_has_hw_fp8", lambda index: False)
    with pytest.raises(
        RuntimeError, match=r"cuda:0 has compute capability 8\.0\. Use quantize_into"
    ):
        codec._require_hw_fp8("quantize_triton", "quantize_into", torch.device("cuda:0"))
    assert not codec.triton_supported(torch.device("cuda:0"))


def test_triton_is_imported_only_inside_functions() -> None:
    """Importing the module must not import triton (nor touch CUDA): every ``import
    triton`` sits in a function body (the CPU path never reaches it: see above)."""
    tree = ast.parse(Path(codec.__file__).read_text())
    for node in tree.body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import | ast.ImportFrom) and not isinstance(
                node, ast.FunctionDef
            ):
                names = [a.name for a in sub.names] + [getattr(sub, "module", None) or ""]
                assert not any(name.split(".")[0] == "triton" for name in names), names


def probe_values() -> torch.Tensor:
    """float32 values at every rounding boundary of e4m3fn (each midpoint between two
    codes and its float32 neighbours, with both signs, fp32 subnormals), laid out so
    every block also holds 448: its scale is exactly 1, so ``x * inv == x``."""
    vals = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = ((vals[:-1].double() + vals[1:].double()) / 2).float()
    bits = mids.view(torch.int32)
    extra = torch.tensor([2.0**-126, 1e-40, 2.0**-149, 447.99, 0.0])
    p = torch.cat([vals, mids, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
    p = torch.cat([p, extra, -p, -extra])
    chunks = p.split(BLOCK - 1)
    return torch.cat(
        [torch.cat([ch, torch.tensor([448.0]), torch.zeros(BLOCK - 1 - len(ch))]) for ch in chunks]
    )


def test_probe_values_match_reference() -> None:
    x = probe_values()
    assert (codec.unpack_scales(encode(x), x.numel()) == 1).all()
    assert np.array_equal(split(encode(x), x.numel())[1], reference(x)[1])


# --------------------------------------------------------------------------------------
# GPU

GPU_SIZES = [1, 127, 128, 129, 4095, 4096, 4097, 3 * 4096 + 17, 2**20 + 3]


def gpu_sample(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A mixture on the CPU: blocks from every distribution, a zero block, a non-finite
    block, and the e4m3 rounding-boundary probes when there is room."""
    parts = [sample(kind, n, dtype, seed=seed + i) for i, kind in enumerate(KINDS)]
    choice = (torch.arange(n) // BLOCK) % len(KINDS)
    x = torch.stack(parts)[choice, torch.arange(n)]
    if n > 4 * BLOCK:
        x[3 * BLOCK + 1] = float("nan")
        x[2 * BLOCK : 3 * BLOCK] = 0
    probes = probe_values().to(dtype)
    if n >= 8 * BLOCK + probes.numel():
        x[8 * BLOCK : 8 * BLOCK + probes.numel()] = probes
    return x


def describe_difference(name: str, a: torch.Tensor, b: torch.Tensor, n: int) -> str:
    nb = -(-n // BLOCK)
    a, b = a.cpu(), b.cpu()
    diff = (a != b).nonzero().flatten()
    in_scales = int((diff < 4 * nb).sum())
    first = int(diff[0]) if diff.numel() else -1
    return (
        f"{name}: {diff.numel()} of {a.numel()} packed bytes differ "
        f"({in_scales} in the scales, {diff.numel() - in_scales} in the codes); first at "
        f"byte {first}: {a[first].item() if first >= 0 else None} vs "
        f"{b[first].item() if first >= 0 else None}"
    )


@on_cuda
@pytest.mark.parametrize("n", GPU_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_triton_bitwise_equals_eager(dtype, n) -> None:
    """Triton, eager on the GPU and eager on the CPU give the same packed bytes and the same decodes. When this fails,
    ``test_cuda_triton_within_error_bound`` says whether the bound still holds."""
    _skip_without_triton()
    x_cpu = gpu_sample(n, dtype, seed=n)
    x = x_cpu.cuda()
    size = packed_nbytes(n)
    tri = torch.empty(size, dtype=torch.uint8, device="cuda")
    eag = torch.empty(size, dtype=torch.uint8, device="cuda")
    cpu = torch.empty(size, dtype=torch.uint8)
    codec.quantize_triton(x, tri)
    codec.quantize_eager(x, eag)
    codec.quantize_eager(x_cpu, cpu)
    problems = []
    if not torch.equal(eag.cpu(), cpu):
        problems.append(describe_difference("eager cuda vs eager cpu", eag, cpu, n))
    if not torch.equal(tri.cpu(), cpu):
        problems.append(describe_difference("triton vs eager cpu", tri, cpu, n))
    y_tri = torch.empty_like(x)
    y_eag = torch.empty_like(x)
    codec.dequantize_triton(cpu.cuda(), y_tri)
    codec.dequantize_eager(cpu.cuda(), y_eag)
    y_cpu = decode(cpu, x_cpu)
    for name, y in (("triton decode", y_tri), ("eager cuda decode", y_eag)):
        if not same_decode(y, y_cpu):
            nan = torch.isnan(y_cpu)
            differ = int((y.cpu()[~nan].view(torch.uint8) != y_cpu[~nan].view(torch.uint8)).sum())
            nan_differ = int((torch.isnan(y.cpu()) != nan).sum())
            problems.append(
                f"{name} vs eager cpu decode: {differ} bytes of non-NaN values differ, "
                f"{nan_differ} elements NaN in one only"
            )
    assert not problems, "NOT bitwise equal: " + "; ".join(problems)


@on_cuda
@pytest.mark.parametrize("n", GPU_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_triton_within_error_bound(dtype, n) -> None:
    """The Triton round trip meets the stated bound; non-finite elements decode to NaN."""
    _skip_without_triton()
    x_cpu = gpu_sample(n, dtype, seed=n)
    x = x_cpu.cuda()
    packed = torch.empty(packed_nbytes(n), dtype=torch.uint8, device="cuda")
    codec.quantize_triton(x, packed)
    y = torch.empty_like(x)
    codec.dequantize_triton(packed, y)
    check_bound(x_cpu, y, packed)
    finite = torch.isfinite(x_cpu)
    assert torch.isnan(y.cpu()[~finite]).all()
    assert torch.isfinite(y.cpu()[finite]).all()


def _skip_without_triton() -> None:
    if not codec.triton_available():
        pytest.skip("needs triton (not installed): CUDA tensors take the eager path")
    if not codec.triton_supported(torch.device("cuda")):
        major, minor = torch.cuda.get_device_capability()
        pytest.skip(
            f"needs hardware fp8 conversion (NVIDIA, compute capability 8.9 or newer); "
            f"this GPU ({'ROCm' if torch.version.hip else f'{major}.{minor}'}) takes the "
            "eager path"
        )


@on_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_dispatch_no_allocation_no_sync_unaligned(dtype) -> None:
    _skip_without_triton()
    n = 2**20 + 77
    x_cpu = gpu_sample(n, dtype, seed=1)
    x = x_cpu.cuda()
    size = packed_nbytes(n)
    buf = torch.zeros(size + 4, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for offset in (0, 1, 3):
        packed = buf[offset : offset + size]
        codec.quantize_into(x, packed)  # compile outside the measured span
        codec.dequantize_into(packed, y)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_sync_debug_mode("error")
        try:
            codec.quantize_into(x, packed)
            codec.dequantize_into(packed, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert codec._triton_failure is None  # no fallback to the eager codec
        assert torch.cuda.max_memory_allocated() == base
        ref = torch.empty(size, dtype=torch.uint8)
        codec.quantize_eager(x_cpu, ref)
        assert torch.equal(packed.cpu(), ref), offset
        assert same_decode(y, decode(ref, x_cpu)), offset


@on_cuda
def test_cuda_runs_on_the_current_stream() -> None:
    _skip_without_triton()
    n = 2**22 + 5
    x_cpu = gpu_sample(n, torch.bfloat16, seed=2)
    src = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    host = x_cpu.pin_memory()
    packed = torch.zeros(packed_nbytes(n), dtype=torch.uint8, device="cuda")
    y = torch.zeros_like(src)
    codec.quantize_into(src, packed)  # compile first
    codec.dequantize_into(packed, y)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream runs late: src is written late
        src.copy_(host, non_blocking=True)
        codec.quantize_into(src, packed)
        codec.dequantize_into(packed, y)
    side.synchronize()
    ref = torch.empty(packed_nbytes(n), dtype=torch.uint8)
    codec.quantize_eager(x_cpu, ref)
    assert torch.equal(packed.cpu(), ref)
    assert same_decode(y, decode(ref, x_cpu))


@on_cuda
def test_cuda_other_device_than_current() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _skip_without_triton()
    x_cpu = gpu_sample(5000, torch.float16, seed=3)
    x = x_cpu.to("cuda:1")
    packed = torch.empty(packed_nbytes(5000), dtype=torch.uint8, device="cuda:1")
    with torch.cuda.device(0):
        codec.quantize_into(x, packed)
        y = torch.empty_like(x)
        codec.dequantize_into(packed, y)
    ref = torch.empty(packed_nbytes(5000), dtype=torch.uint8)
    codec.quantize_eager(x_cpu, ref)
    assert torch.equal(packed.cpu(), ref)
    assert same_decode(y, decode(ref, x_cpu))


@on_cuda
def test_cuda_offsets_past_2_pow_31() -> None:
    """2**31 + 1000 bfloat16 elements: the last blocks (element and byte offsets above
    2**31) match the eager encoding of the same blocks quantized on their own."""
    _skip_without_triton()
    n = 2**31 + 1000
    need = 2 * n + packed_nbytes(n) + 2 * n
    if torch.cuda.mem_get_info()[0] < need + 2**30:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    x = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    tail_start = (n // BLOCK - 40) * BLOCK  # 40 whole blocks and the partial one
    tail = gpu_sample(n - tail_start, torch.bfloat16, seed=4)
    x[tail_start:] = tail.cuda()
    packed = torch.empty(packed_nbytes(n), dtype=torch.uint8, device="cuda")
    codec.quantize_into(x, packed)
    y = torch.empty_like(x)
    codec.dequantize_into(packed, y)
    ref = torch.empty(packed_nbytes(tail.numel()), dtype=torch.uint8)
    codec.quantize_eager(tail, ref)
    nb, tb, first = -(-n // BLOCK), -(-tail.numel() // BLOCK), tail_start // BLOCK
    assert torch.equal(packed[4 * first : 4 * nb].cpu(), ref[: 4 * tb])
    assert torch.equal(packed[4 * nb + tail_start :].cpu(), ref[4 * tb :])
    assert same_decode(y[tail_start:], decode(ref, tail))
    assert not y[:tail_start].any()
