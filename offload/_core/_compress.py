"""Blockwise FP8 codec for compressed offload: quantize on the device right before the
device -> host copy, dequantize right after the host -> device copy.

Layout
------
A span of ``n`` elements is cut into ``nb = ceil(n / BLOCK)`` blocks of :data:`BLOCK`
(128) consecutive elements (the last one may be partial). Its packed form is one
``uint8`` buffer of :func:`packed_nbytes` ``(n) = 4 * nb + n`` bytes:

* bytes ``[0, 4 * nb)``: the ``nb`` float32 scales, little-endian, one per block;
* bytes ``[4 * nb, 4 * nb + n)``: the ``n`` float8_e4m3fn codes, in element order.

The buffer may start at any byte address (scales are written and read byte by byte on
the GPU path and through a copy on the eager path), so packed spans can lie back to back.

Encoding (invariant; both implementations compute exactly this)
-----------------------------------------------------------------
Per block, in float32 (``x`` is the element converted to float32, which is exact), with
every operation rounded to nearest-even and no flush of subnormals:

1. ``amax = max |x|`` over the block's *finite* elements (0 if there is none), computed
   on the bit patterns (``bits(x) & 0x7FFFFFFF`` compared as integers, which orders
   non-negative floats; patterns of inf and NaN, ``>= 0x7F800000``, count as 0).
2. ``scale = max(amax / 448, 2**-126)`` (true division; 448 is the largest finite
   e4m3fn value; the floor 2**-126, float32's smallest normal, keeps the scale normal and
   gives an all-zero block a positive scale); ``inv = 1 / scale`` (true division, once
   per block).
3. A finite element: ``q = e4m3fn_rne(clamp(x * inv, -448, 448))``: the multiplication
   by the block's reciprocal, not a per-element division, rounded once more to
   nearest-even in float32, then converted to e4m3fn rounding to nearest, ties to even
   (subnormal codes included; the sign of zero is kept). A non-finite element (inf or
   NaN): the NaN code ``0x7F``.

Decoding: ``out = cast_to_original_dtype(float32(q) * scale)`` (one float32
multiplication, then round to nearest-even into bfloat16 / float16, or nothing for
float32). Consequences:

* zeros (of either sign) decode to exactly the same zero;
* an inf or NaN element decodes to NaN, and only that element: its block's other
  elements decode as if it were 0 (so bytes a span holds beside the saved tensor's own,
  whatever they are, never turn its elements into NaN); nothing raises;
* no finite input decodes to ``inf`` (checked exhaustively over float32's top binade:
  ``448 * (amax / 448)`` never rounds up to infinity).

Error bound
-----------
For a finite element ``x`` of a block with stored scale ``s``, decoded as ``y``:

.. code-block:: text

    |y - x| <= (1 + u) * [(2**-4 + 2**-22) * |x| + (2**-10 + 2**-23) * s] + u * |x| + eta

with ``u`` = 2**-8 (bfloat16), 2**-11 (float16), 0 (float32) the unit roundoff of the
final cast and ``eta`` = 2**-134 (bfloat16), 2**-25 (float16), 0 (float32) half the
spacing of that dtype's subnormals; to first order ``2**-4 * |x| + 2**-10 * s`` plus the
final cast's ``u * |x|``. Derivation, with ``t = x / s`` (exact):

* ``fl(x * inv) = t * (1 + d0) * (1 + d1)`` with ``|d0|, |d1| <= 2**-24`` (plus at most
  2**-150 absolute where the product is subnormal). Clamping to +-448 moves it towards
  ``t`` when ``|t| <= 448``; ``|t|`` can exceed 448 only through the rounding of
  ``amax / 448`` (``s >= (amax / 448) * (1 - 2**-24)``), by at most ``2**-24 * |t|``.
  So the clamped ``c`` has ``|c - t| <= 2**-22.9 * |t| + 2**-150``.
* e4m3 has 3 mantissa bits: rounding ``c`` to nearest errs by at most ``2**-4 * |c|``
  for ``|c| >= 2**-6`` and by half the subnormal spacing 2**-9, ``2**-10``, below.
* ``q * s - x = s * (q - c) + s * (c - t)``, and ``|c| * s <= |x| * (1 + 2**-22) +
  2**-150 * s``; the float32 product ``fl(q * s)`` adds ``2**-24 * |q * s|`` (or
  2**-150 <= ``2**-24 * s`` absolute when subnormal, as ``s >= 2**-126``). Summed, the
  float32 decode ``y32`` has ``|y32 - x| <= (2**-4 + 2**-22) * |x| + (2**-10 + 2**-23)
  * s`` (the bracket).
* The final cast adds at most ``u * |y32| + eta`` and ``|y32| <= |x| + bracket``.

Since ``s`` is about ``amax / 448``, ``2**-10 * s`` is about ``2.2e-6 * amax``:
elements far smaller than their block's largest lose their relative precision.
:func:`error_bound` evaluates the bound; the tests check it on several distributions and
that it is nearly attained (worst error / bound above 0.75 on normal data).

Implementations
---------------
* eager (:func:`quantize_eager`, :func:`dequantize_eager`): torch operations on any
  device (the CPU path, the reference, and the fallback on GPUs the Triton kernels do
  not serve); pads the last block and allocates float32 temporaries of the span's size.
* Triton (:func:`quantize_triton`, :func:`dequantize_triton`), used for CUDA tensors
  when ``triton`` imports and the GPU converts float32 <-> e4m3fn in hardware (NVIDIA,
  compute capability 8.9 or newer: ``cvt.rn.satfinite``; :func:`triton_supported`): one
  fused kernel each way, one read and one write of the data, no allocation, no host
  synchronisation, on the current stream; each program handles a tile of blocks
  (:data:`TILING`: blocks per program and warps, per kernel). Whole tiles load and store without masks (only the
  last program is masked), so the accesses are 16-byte vectors where the addresses
  allow: the data tensor, and the codes when ``out.data_ptr() + 4 * nb`` is a multiple
  of 16 (``nb`` a multiple of 4 and ``out`` 16-byte aligned); otherwise the codes go
  byte by byte (still coalesced).

GPUs older than sm_89, ROCm devices, and machines without ``triton`` use the eager codec
(slower, allocates float32 temporaries); so does the CPU, which never imports ``triton``.
``triton`` is imported lazily, on the first call for a supported GPU; importing this
module touches no CUDA state.

>>> x = torch.randn(300, dtype=torch.bfloat16)
>>> packed = torch.empty(packed_nbytes(x.numel()), dtype=torch.uint8)
>>> quantize_into(x, packed)
>>> y = torch.empty_like(x)
>>> dequantize_into(packed, y)
>>> bound = error_bound(x, unpack_scales(packed, x.numel()))
>>> bool(((y.double() - x.double()).abs() <= bound).all())
True
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from offload._core._warn import warn_at_caller

#: ``triton.language``, bound by :func:`_define_kernels` (the kernels read it as a global)
tl: Any

__all__ = [
    "HALF", "BLOCK", "COMPRESSIBLE", "TILING", "packed_nbytes", "quantize_into",
    "dequantize_into", "quantize_eager", "dequantize_eager", "quantize_triton",
    "dequantize_triton", "triton_available", "triton_supported", "unpack_scales",
    "error_bound",
]  # fmt: skip

BLOCK: int = 128
"""Elements per scale block (consecutive elements of the flat span)."""

COMPRESSIBLE: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32})
"""The dtypes :func:`quantize_into` accepts and :func:`dequantize_into` restores."""

HALF: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16})
"""The dtypes compressed without a ``compress_filter`` (fp32 tensors then travel exactly)."""

TILING: dict[str, tuple[int, int]] = {"quantize": (32, 8), "dequantize": (8, 4)}
"""Per Triton kernel: (blocks of :data:`BLOCK` elements handled by one program, warps per
program), the fastest of ``benchmarks/compress/bench_codec.py --sweep`` (docs/decisions.md)."""

_FP8_MAX = 448.0
_SCALE_MIN = 2.0**-126
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_NAN_CODE = 0x7F  # the e4m3fn NaN code every non-finite element is encoded as
_FP8 = torch.float8_e4m3fn
_ACCEPTED = "torch.bfloat16, torch.float16, torch.float32"

# (unit roundoff, half the subnormal spacing) of the final cast, per dtype
_CAST_ERROR: dict[torch.dtype, tuple[float, float]] = {
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float16: (2.0**-11, 2.0**-25),
    torch.float32: (0.0, 0.0),
}


def packed_nbytes(numel: int) -> int:
    """Bytes of the packed form of ``numel`` elements: ``4 * ceil(numel / BLOCK) + numel``.

    Args:
        numel: number of elements of the span (``>= 0``).

    Returns:
        The size in bytes of the ``uint8`` buffer :func:`quantize_into` fills.

    Raises:
        ValueError: ``numel`` is not a non-negative integer.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"packed_nbytes(numel={numel!r}): expected an integer >= 0")
    return 4 * (-(-numel // BLOCK)) + numel


# --------------------------------------------------------------------------------------
# argument checks


def _describe(t: torch.Tensor) -> str:
    return (
        f"a tensor of shape {tuple(t.shape)}, dtype {t.dtype}, "
        f"{'contiguous' if t.is_contiguous() else 'non-contiguous'}, on {t.device}"
    )


def _check_data(name: str, fn: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}({name}=...): expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in COMPRESSIBLE or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{fn}({name}=...): expected a 1-D contiguous tensor of dtype {_ACCEPTED}; "
            f"got {_describe(t)}"
        )


def _check_packed(name: str, fn: str, t: Any, numel: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}({name}=...): expected a torch.Tensor, got {type(t).__name__}")
    want = packed_nbytes(numel)
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() or t.numel() != want:
        raise ValueError(
            f"{fn}({name}=...): expected a 1-D contiguous torch.uint8 tensor of "
            f"packed_nbytes({numel}) = {want} bytes; got {_describe(t)}"
        )
    if t.device != device:
        raise ValueError(
            f"{fn}({name}=...): expected a tensor on {device} (the data's device); "
            f"got one on {t.device}"
        )


# --------------------------------------------------------------------------------------
# public entry points


def quantize_into(src: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize ``src`` blockwise to FP8 and write the packed form into ``out``.

    CUDA tensors go through the fused Triton kernel (no allocation, no host
    synchronisation, current stream) when :func:`triton_supported` (``triton`` imports
    and the GPU has hardware fp8 conversion, compute capability 8.9 or newer), otherwise
    through :func:`quantize_eager` (also, with a warning, from the first time a kernel
    fails to compile with the installed triton). The numerics are the module's invariant.

    Args:
        src: 1-D contiguous tensor of dtype bfloat16, float16 or float32, ``n`` elements
            (any ``n >= 0``).
        out: 1-D contiguous ``torch.uint8`` tensor of :func:`packed_nbytes` ``(n)`` bytes
            on ``src``'s device; overwritten.

    Raises:
        ValueError: ``src`` or ``out`` has the wrong dtype, shape, size, layout or device
            (the message names the argument and what it accepts).
    """
    _check_data("src", "quantize_into", src)
    _check_packed("out", "quantize_into", out, src.numel(), src.device)
    if src.numel() == 0:
        return
    kernels = _dispatch_kernels(src.device)
    if kernels is not None:
        try:
            _launch_quantize(kernels, src, out)
            return
        except Exception as exc:  # the kernel does not compile with this triton
            _give_up_triton(exc)
    _quantize_eager(src, out)


def dequantize_into(packed: torch.Tensor, out: torch.Tensor) -> None:
    """Decode the packed form written by :func:`quantize_into` into ``out``, in place.

    CUDA tensors go through the fused Triton kernel when :func:`triton_supported`,
    otherwise through :func:`dequantize_eager` (as for :func:`quantize_into`).

    Args:
        packed: 1-D contiguous ``torch.uint8`` tensor of :func:`packed_nbytes` ``(n)``
            bytes, as :func:`quantize_into` filled it.
        out: 1-D contiguous tensor of the original dtype (bfloat16, float16 or
            float32) and ``n`` elements, on ``packed``'s device; overwritten.

    Raises:
        ValueError: ``packed`` or ``out`` has the wrong dtype, shape, size, layout or
            device (the message names the argument and what it accepts).
    """
    _check_data("out", "dequantize_into", out)
    _check_packed("packed", "dequantize_into", packed, out.numel(), out.device)
    if out.numel() == 0:
        return
    kernels = _dispatch_kernels(out.device)
    if kernels is not None:
        try:
            _launch_dequantize(kernels, packed, out)
            return
        except Exception as exc:  # the kernel does not compile with this triton
            _give_up_triton(exc)
    _dequantize_eager(packed, out)


def quantize_eager(src: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`quantize_into` with torch operations, on any device (allocates temporaries).

    Args:
        src: as for :func:`quantize_into`.
        out: as for :func:`quantize_into`.

    Raises:
        ValueError: as for :func:`quantize_into`.
    """
    _check_data("src", "quantize_eager", src)
    _check_packed("out", "quantize_eager", out, src.numel(), src.device)
    if src.numel():
        _quantize_eager(src, out)


def dequantize_eager(packed: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`dequantize_into` with torch operations, on any device (allocates temporaries).

    Args:
        packed: as for :func:`dequantize_into`.
        out: as for :func:`dequantize_into`.

    Raises:
        ValueError: as for :func:`dequantize_into`.
    """
    _check_data("out", "dequantize_eager", out)
    _check_packed("packed", "dequantize_eager", packed, out.numel(), out.device)
    if out.numel():
        _dequantize_eager(packed, out)


def quantize_triton(src: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`quantize_into` through the Triton kernel, never the eager codec.

    Args:
        src: as for :func:`quantize_into`, on a CUDA device with hardware fp8 conversion
            (NVIDIA, compute capability 8.9 or newer).
        out: as for :func:`quantize_into`.

    Raises:
        ValueError: as for :func:`quantize_into`.
        RuntimeError: ``src`` is not on such a device, or ``triton`` cannot be imported
            (:func:`quantize_into` takes the eager codec in both cases).
    """
    _check_data("src", "quantize_triton", src)
    _check_packed("out", "quantize_triton", out, src.numel(), src.device)
    _require_hw_fp8("quantize_triton", "quantize_into", src.device)
    kernels = _require_kernels()
    if src.numel():
        _launch_quantize(kernels, src, out)


def dequantize_triton(packed: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`dequantize_into` through the Triton kernel, never the eager codec.

    Args:
        packed: as for :func:`dequantize_into`.
        out: as for :func:`dequantize_into`, on a CUDA device with hardware fp8
            conversion (NVIDIA, compute capability 8.9 or newer).

    Raises:
        ValueError: as for :func:`dequantize_into`.
        RuntimeError: ``out`` is not on such a device, or ``triton`` cannot be imported
            (:func:`dequantize_into` takes the eager codec in both cases).
    """
    _check_data("out", "dequantize_triton", out)
    _check_packed("packed", "dequantize_triton", packed, out.numel(), out.device)
    _require_hw_fp8("dequantize_triton", "dequantize_into", out.device)
    kernels = _require_kernels()
    if out.numel():
        _launch_dequantize(kernels, packed, out)


# --------------------------------------------------------------------------------------
# helpers for tests and diagnostics


def unpack_scales(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 block scales stored in a packed buffer (a copy).

    Args:
        packed: the ``uint8`` buffer of :func:`packed_nbytes` ``(numel)`` bytes.
        numel: the number of elements the buffer encodes.

    Returns:
        A float32 tensor of ``ceil(numel / BLOCK)`` scales (always finite and positive).

    Raises:
        ValueError: ``packed`` is not a 1-D contiguous uint8 tensor of that size.
    """
    device = packed.device if isinstance(packed, torch.Tensor) else torch.device("cpu")
    _check_packed("packed", "unpack_scales", packed, numel, device)
    nb = -(-numel // BLOCK)
    return packed[: 4 * nb].clone().view(torch.float32)


def error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The module's per-element bound on ``|decode(encode(x)) - x|``, in float64.

    Args:
        x: the original 1-D tensor (bfloat16, float16 or float32).
        scales: its block scales, as :func:`unpack_scales` returns them.

    Returns:
        A float64 tensor shaped like ``x``; ``nan`` at non-finite elements (no bound:
        they decode to NaN).

    Raises:
        ValueError: ``x`` is not a 1-D tensor of a compressible dtype, or ``scales`` does
            not hold one value per block.
    """
    _check_data("x", "error_bound", x)
    nb = -(-x.numel() // BLOCK)
    if not isinstance(scales, torch.Tensor) or scales.shape != (nb,):
        raise ValueError(f"error_bound(scales=...): expected {nb} scales (one per block)")
    u, eta = _CAST_ERROR[x.dtype]
    ax = x.to(device="cpu", dtype=torch.float64).abs()
    s = scales.to(device="cpu", dtype=torch.float64).repeat_interleave(BLOCK)[: x.numel()]
    inner = (2.0**-4 + 2.0**-22) * ax + (2.0**-10 + 2.0**-23) * s
    bound = (1.0 + u) * inner + u * ax + eta
    return torch.where(torch.isfinite(ax), bound, torch.full_like(bound, float("nan")))


# --------------------------------------------------------------------------------------
# eager implementation


def _quantize_eager(src: torch.Tensor, out: torch.Tensor) -> None:
    n = src.numel()
    nb = -(-n // BLOCK)
    with torch.no_grad():
        x = src.to(torch.float32)
        if nb * BLOCK != n:
            x = torch.nn.functional.pad(x, (0, nb * BLOCK - n))
        x = x.view(nb, BLOCK)
        bits = torch.bitwise_and(x.view(torch.int32), _ABS_MASK)
        finite = bits < _INF_BITS
        zero = torch.zeros((), dtype=bits.dtype, device=bits.device)
        amax = torch.where(finite, bits, zero).amax(dim=1).view(torch.float32)
        # tensor / tensor of the same shape: true division on every device (a Python
        # scalar divisor may become a multiplication by its reciprocal on CUDA)
        scale = torch.div(amax, torch.full_like(amax, _FP8_MAX)).clamp_(min=_SCALE_MIN)
        inv = torch.reciprocal(scale)
        y = (x * inv[:, None]).clamp_(-_FP8_MAX, _FP8_MAX)
        y = torch.where(finite, y, torch.zeros((), dtype=y.dtype, device=y.device))
        q = y.view(-1)[:n].to(_FP8).view(torch.uint8)
        nan_code = torch.full((), _NAN_CODE, dtype=torch.uint8, device=q.device)
        q = torch.where(finite.view(-1)[:n], q, nan_code)
        out[: 4 * nb].copy_(scale.view(torch.int32).view(torch.uint8))
        out[4 * nb :].copy_(q)


def _dequantize_eager(packed: torch.Tensor, out: torch.Tensor) -> None:
    n = out.numel()
    nb = -(-n // BLOCK)
    with torch.no_grad():
        # the copy makes the scales 4-byte aligned whatever packed's offset
        scale = packed[: 4 * nb].clone().view(torch.float32)
        q = packed[4 * nb :].view(_FP8).to(torch.float32)
        if nb * BLOCK != n:
            q = torch.nn.functional.pad(q, (0, nb * BLOCK - n))
        y = q.view(nb, BLOCK) * scale[:, None]
        out.copy_(y.view(-1)[:n])


# --------------------------------------------------------------------------------------
# Triton implementation


#: Why the dispatching functions stopped using Triton (a kernel failed to compile or
#: launch with the installed triton), or None.
_triton_failure: str | None = None


def triton_available() -> bool:
    """Whether ``triton`` imports (see :func:`triton_supported` for a given device)."""
    return _kernels() is not None


def triton_supported(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` can take the fused Triton kernels: a CUDA device with
    hardware float32 <-> e4m3fn conversion (NVIDIA, compute capability 8.9 or newer; not
    ROCm) and ``triton`` imports. Elsewhere :func:`quantize_into` and
    :func:`dequantize_into` use the eager codec. Imports ``triton`` only for such a
    device."""
    device = torch.device(device)
    return _device_has_hw_fp8(device) and _kernels() is not None


def _dispatch_kernels(device: torch.device) -> SimpleNamespace | None:
    """The kernels :func:`quantize_into` / :func:`dequantize_into` use on ``device``, or
    None for the eager codec (checked before importing ``triton``: the CPU never does)."""
    if _triton_failure is not None or not _device_has_hw_fp8(device):
        return None
    return _kernels()


@functools.cache
def _kernels() -> SimpleNamespace | None:
    try:
        return _build_kernels()
    except ImportError:
        return None
    except Exception as exc:  # a broken installation: the eager codec still works
        _give_up_triton(exc)
        return None


def _give_up_triton(exc: Exception) -> None:
    """Send CUDA tensors to the eager codec from now on, saying why, once."""
    global _triton_failure
    _triton_failure = f"{type(exc).__name__}: {exc}"
    warn_at_caller(
        "offload: the Triton FP8 codec failed; compressed offload falls back to the eager "
        f"codec (slower, allocates temporaries). Cause: {_triton_failure[:2000]}"
    )


def _require_kernels() -> SimpleNamespace:
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError(
            "the Triton codec needs the 'triton' package, which is not installed or fails "
            f"to import ({_triton_failure})"
        )
    return kernels


_MIN_CAPABILITY = (8, 9)


@functools.cache
def _index_has_hw_fp8(index: int) -> bool:
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index) >= _MIN_CAPABILITY


def _device_has_hw_fp8(device: torch.device) -> bool:
    """Does ``device`` convert float32 <-> e4m3fn in hardware (round to nearest even)?"""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _index_has_hw_fp8(index)


def _require_hw_fp8(fn: str, fallback: str, device: torch.device) -> None:
    if _device_has_hw_fp8(device):
        return
    need = (
        "the Triton FP8 codec needs an NVIDIA GPU with hardware float32 <-> float8_e4m3fn "
        f"conversion (compute capability {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]} or "
        "newer)"
    )
    if device.type != "cuda":
        got = f"the tensors are on {device}"
    elif torch.version.hip is not None:
        got = f"{device} is a ROCm device"
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        got = f"{device} has compute capability {major}.{minor}"
    raise RuntimeError(
        f"{fn}: {need}; {got}. Use {fallback}, which falls back to the eager codec there."
    )


def _launch(kernel: Any, device: torch.device, grid: tuple[int], *args: Any, **meta: Any) -> None:
    if device.type == "cuda" and device.index is not None:
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device.index):
                kernel[grid](*args, **meta)
            return
    kernel[grid](*args, **meta)


def _launch_quantize(kernels: SimpleNamespace, src: torch.Tensor, out: torch.Tensor) -> None:
    n = src.numel()
    nb = -(-n // BLOCK)
    rows, warps = TILING["quantize"]
    grid = (-(-nb // rows),)
    _launch(
        kernels.quantize,
        src.device,
        grid,
        src,
        out,
        out[4 * nb :],  # its own argument: Triton vectorises when this address is aligned
        n,
        nb,
        BLOCK=BLOCK,
        ROWS=rows,
        num_warps=warps,
    )


def _launch_dequantize(kernels: SimpleNamespace, packed: torch.Tensor, out: torch.Tensor) -> None:
    n = out.numel()
    nb = -(-n // BLOCK)
    rows, warps = TILING["dequantize"]
    grid = (-(-nb // rows),)
    _launch(
        kernels.dequantize,
        out.device,
        grid,
        packed,
        packed[4 * nb :],
        out,
        n,
        nb,
        BLOCK=BLOCK,
        ROWS=rows,
        num_warps=warps,
    )


def _build_kernels() -> SimpleNamespace:
    """Define the Triton kernels (imports ``triton``; raises ``ImportError`` without it).

    Triton resolves the names a kernel uses (``tl``) in the kernel's module globals, not
    in enclosing scopes, so the lazily imported ``triton.language`` is bound as a global
    of this module here. The float32 <-> e4m3fn conversions are the hardware ones
    (``tl.float8e4nv``; the caller checks the device: compute capability 8.9 or newer).
    """
    global tl
    import triton
    import triton.language as tl

    # the sizes are not specialised (a recompilation per n % 16 would buy nothing: whole
    # tiles are unmasked anyway); the pointers are (16-byte alignment enables vectors)
    @triton.jit(do_not_specialize=["n", "n_blocks"])
    def quantize(
        src_ptr,
        scales_ptr,
        codes_ptr,
        n,
        n_blocks,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        row0 = pid * ROWS
        start = row0 * BLOCK
        rows = tl.arange(0, ROWS)
        local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = local < n - start
        # whole tiles load and store without a mask (a mask from a ragged n would stop
        # Triton from vectorising); only the last program takes the masked branch
        full = start + ROWS * BLOCK <= n
        if full:
            x = tl.load(src_ptr + start + local)
        else:
            x = tl.load(src_ptr + start + local, mask=mask, other=0.0)
        x = x.to(tl.float32)

        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        finite = bits < 0x7F800000  # per element
        amax = tl.max(tl.where(finite, bits, 0), axis=1).to(tl.float32, bitcast=True)
        scale = tl.maximum(tl.math.div_rn(amax, tl.full([ROWS], 448.0, tl.float32)), 2.0**-126)
        inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)

        y = x * inv[:, None]
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        y = tl.where(finite, y, 0.0)  # no inf or NaN reaches the conversion
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        q = tl.where(finite, q, 0x7F).to(tl.uint8)  # the NaN code
        if full:
            tl.store(codes_ptr + start + local, q)
        else:
            tl.store(codes_ptr + start + local, q, mask=mask)

        scale_bits = scale.to(tl.int32, bitcast=True)
        srow = row0 + rows
        byte = tl.arange(0, 4)
        sbytes = ((scale_bits[:, None] >> (byte[None, :] * 8)) & 0xFF).to(tl.uint8)
        tl.store(
            scales_ptr + srow[:, None] * 4 + byte[None, :],
            sbytes,
            mask=(srow < n_blocks)[:, None],
        )

    @triton.jit(do_not_specialize=["n", "n_blocks"])
    def dequantize(
        scales_ptr,
        codes_ptr,
        out_ptr,
        n,
        n_blocks,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        row0 = pid * ROWS
        start = row0 * BLOCK
        rows = tl.arange(0, ROWS)
        srow = row0 + rows
        byte = tl.arange(0, 4)
        sbytes = tl.load(
            scales_ptr + srow[:, None] * 4 + byte[None, :],
            mask=(srow < n_blocks)[:, None],
            other=0,
        ).to(tl.uint32)
        scale_bits = tl.sum(sbytes << (byte[None, :] * 8).to(tl.uint32), axis=1)
        scale = scale_bits.to(tl.float32, bitcast=True)

        local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = local < n - start
        full = start + ROWS * BLOCK <= n
        if full:
            code = tl.load(codes_ptr + start + local)
        else:
            code = tl.load(codes_ptr + start + local, mask=mask, other=0)
        qf = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        y = (qf * scale[:, None]).to(out_ptr.dtype.element_ty)
        if full:
            tl.store(out_ptr + start + local, y)
        else:
            tl.store(out_ptr + start + local, y, mask=mask)

    return SimpleNamespace(quantize=quantize, dequantize=dequantize)
