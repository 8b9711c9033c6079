"""``OffloadConfig``: every knob of :class:`offload.ActivationOffloader` in one frozen object."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["COMPRESS_MODES", "LayerSelection", "OffloadConfig", "SELECTION_MODES"]

#: What ``offload_layers`` accepts: ``"auto"`` (as many as the link hides), ``"all"`` or
#: ``None`` (all but the last), ``int`` n (the first n), a sequence of indices, or
#: ``callable(index, module) -> bool``.
LayerSelection = None | str | int | Sequence[int] | Callable[[int, torch.nn.Module], bool]

#: The strings ``offload_layers`` accepts.
SELECTION_MODES = ("auto", "all")

#: What ``compress`` accepts besides ``None`` (lossless, the default).
COMPRESS_MODES = ("fp8",)


def _type_name(value: Any) -> str:
    return type(value).__name__


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Settings of an :class:`~offload.ActivationOffloader`, validated at construction.

    Args:
        offload_layers: which layer calls (groups) are offloaded. ``"auto"`` (default):
            measure the first forward of each kind of input while offloading like
            ``"all"``, then offload the longest prefix of layers whose copies the link
            hides within ``max_slowdown`` (verified against steps without offloading
            while memory allows them), never fewer than the free device memory needs;
            new sequence lengths are predicted from those measured; on a machine
            without an accelerator, like ``"all"``.
            ``"all"`` or ``None``: all but the last. An ``int`` n: the first n; a
            sequence of ``int`` selects by index; a ``callable(index, module) -> bool``
            decides per call.
        min_tensor_bytes: saved tensors whose copied bytes are fewer than this stay on the
            device (reason ``small``). Default ``256 * 1024``.
        prefetch_layers: ``None`` (default) reloads each group as early as the resident
            bound of docs/design.md section 3 allows; an ``int`` n >= 1 reloads a group when the
            backward of the layer n calls after it starts.
        pin_memory: use page-locked host memory (needed for copies that overlap compute).
            Ignored on a machine without an accelerator. Default ``True``.
        host_memory_limit: bytes of host memory the pool may hold; ``None`` (default) is
            half of the available memory divided by ``LOCAL_WORLD_SIZE``.
        double_buffering: reuse reload buffers between groups of equal tensor signature
            during one backward. Default ``False`` (docs/decisions.md has the measurement).
        tensor_filter: ``callable(tensor) -> bool``; ``False`` keeps the tensor on the
            device (reason ``filtered``). Default ``None`` (no filter).
        max_slowdown: the step-time increase ``"auto"`` may spend, as a fraction of the
            step without offloading (predicted from measured compute and link times).
            Default ``0.03``.
        compress: ``None`` (default): every offloaded byte comes back exactly, and
            gradients are bitwise equal to a run without offloading. ``"fp8"``: lossy
            and opt-in: floating tensors (bf16, fp16, fp32) travel as ``float8_e4m3fn``
            with one fp32 scale per 128 consecutive elements (about half the link
            bytes of bf16, a quarter of fp32), quantized on the device before the copy
            and dequantized after the reload; integer, bool and fp8 tensors travel
            unchanged, and so do fp32 ones unless ``compress_filter`` says
            otherwise. The per-element error bound and measured accuracy are in
            docs/compress.md.
        compress_filter: ``callable(tensor) -> bool``: with ``compress="fp8"``, ``True``
            compresses a floating tensor, ``False`` sends it exactly. Default ``None``:
            bf16 and fp16 tensors are compressed, fp32 ones travel exactly (in mixed
            precision those are softmax and norm statistics: on ref-8L they halve the
            gradient error for 0.14 % of the bytes). ``lambda t: True`` compresses fp32
            too (fp32 training).
        timing: record the time of every copy (CUDA events; host clock on the
            synchronous path) and of every wait of the compute stream for a copy, per
            layer, in the stats. Default ``False``.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field has a value outside its accepted range.

    Example:
        >>> cfg = OffloadConfig(offload_layers=2, min_tensor_bytes=1 << 20)
        >>> cfg.offload_layers
        2
    """

    offload_layers: LayerSelection = "auto"
    min_tensor_bytes: int = 256 * 1024
    prefetch_layers: int | None = None
    pin_memory: bool = True
    host_memory_limit: int | None = None
    double_buffering: bool = False
    tensor_filter: Callable[[torch.Tensor], bool] | None = None
    timing: bool = False
    max_slowdown: float = 0.03
    compress: str | None = None
    compress_filter: Callable[[torch.Tensor], bool] | None = None

    def __post_init__(self) -> None:
        sel = self.offload_layers
        if isinstance(sel, str):
            if sel not in SELECTION_MODES:
                raise ValueError(
                    f"offload_layers={sel!r} is not a mode; accepted strings: "
                    f"{', '.join(repr(m) for m in SELECTION_MODES)} (or None, an int, a "
                    f"sequence of ints, a callable(index, module) -> bool)"
                )
            sel = None  # validated; the checks below are for the other forms
        if callable(sel) and not isinstance(sel, (int, Sequence)):
            _check_selector(sel)
        if sel is not None and not callable(sel):
            if isinstance(sel, bool):
                raise TypeError(
                    f"offload_layers must be None, an int, a sequence of ints or a "
                    f"callable(index, module) -> bool; got bool {sel!r}"
                )
            if isinstance(sel, int):
                if sel < 0:
                    raise ValueError(
                        f"offload_layers={sel}: an int selects the first n layers and must be >= 0"
                    )
            elif isinstance(sel, Sequence) and not isinstance(sel, (str, bytes)):
                indices = tuple(sel)
                for i in indices:
                    if isinstance(i, bool) or not isinstance(i, int):
                        raise TypeError(
                            f"offload_layers must hold ints (layer indices); got "
                            f"{_type_name(i)} {i!r} in {sel!r}"
                        )
                    if i < 0:
                        raise ValueError(
                            f"offload_layers={list(indices)}: indices must be >= 0, got {i}"
                        )
                if len(set(indices)) != len(indices):
                    raise ValueError(f"offload_layers={list(indices)} repeats an index")
                object.__setattr__(self, "offload_layers", tuple(sorted(indices)))
            else:
                raise TypeError(
                    f"offload_layers must be None, an int, a sequence of ints or a "
                    f"callable(index, module) -> bool; got {_type_name(sel)} {sel!r}"
                )
        _check_int("min_tensor_bytes", self.min_tensor_bytes, minimum=0)
        if self.prefetch_layers is not None:
            _check_int("prefetch_layers", self.prefetch_layers, minimum=1)
        if self.host_memory_limit is not None:
            _check_int("host_memory_limit", self.host_memory_limit, minimum=0)
        for name in ("pin_memory", "double_buffering", "timing"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {_type_name(value)} {value!r}")
        if isinstance(self.max_slowdown, bool) or not isinstance(self.max_slowdown, (int, float)):
            raise TypeError(
                f"max_slowdown must be a float (a fraction, e.g. 0.03); got "
                f"{_type_name(self.max_slowdown)} {self.max_slowdown!r}"
            )
        if not 0.0 <= self.max_slowdown <= 10.0:
            raise ValueError(
                f"max_slowdown={self.max_slowdown}: must be a fraction between 0 and 10 "
                f"(0.03 = 3% slower at most)"
            )
        for name in ("tensor_filter", "compress_filter"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"{name} must be None or a callable(tensor) -> bool; got "
                    f"{_type_name(value)} {value!r}"
                )
        if self.compress is not None and self.compress not in COMPRESS_MODES:
            raise ValueError(
                f"compress={self.compress!r} is not supported; accepted values: None "
                f"(lossless, the default), {', '.join(repr(m) for m in COMPRESS_MODES)}"
            )
        if self.compress_filter is not None and self.compress is None:
            raise ValueError(
                "compress_filter is set but compress=None: nothing is compressed; pass "
                "compress='fp8' to compress, or drop compress_filter"
            )


def _check_selector(fn: Callable[..., Any]) -> None:
    """A callable ``offload_layers`` must accept ``(index, module)``: checked now, so a
    wrong signature fails here and not at the first forward, deep inside a hook."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        sig.bind(0, None)
    except TypeError:
        raise TypeError(
            f"offload_layers, when callable, is called as offload_layers(index, module) "
            f"and must return a bool; {getattr(fn, '__name__', fn)!r} has signature {sig}, "
            f"which does not accept (index, module). Example: "
            f"offload_layers=lambda index, module: index < 2"
        ) from None


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {_type_name(value)} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")
