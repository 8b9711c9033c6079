"""Saved tensor -> the bytes that must travel, and back.

Pure functions, no state: the scheduler calls them from the pack and unpack hooks.

* :func:`span` gives the minimal byte range of a tensor's storage that covers every
  element the tensor can address (views, transposes, slices, stride-0 expansions).
  Several tensors over one storage share one copy when their spans nest (docs/design.md 4.5).
* :func:`rebuild` turns a reloaded byte span back into a tensor with the same dtype,
  shape and strides (the storage offset is relative to the span).
* :func:`is_parameter_derived` says whether a saved tensor is a parameter in disguise
  (docs/design.md 4.7): ``nn.Linear`` saves ``weight.t()``, autocast saves
  ``weight.to(bf16)``; neither is an ``nn.Parameter`` but neither is an activation.
* :func:`flatten` splits wrapper tensor subclasses (``__tensor_flatten__``) into plain
  inner tensors; :func:`unflatten` rebuilds them (docs/design.md 4.8).
* :func:`is_te_quantized` recognises TransformerEngine's quantized tensors, which are
  split with their own ``prepare_for_saving`` / ``restore_from_saved`` protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "span",
    "rebuild",
    "rebuild_view",
    "as_bytes",
    "is_parameter_derived",
    "derives_from_parameter",
    "CHAIN_NODES",
    "is_plain",
    "flatten",
    "unflatten",
    "unsupported",
    "tensors_requiring_grad",
]

# Autograd nodes that only re-view or re-type their input: a chain of these from a saved
# tensor to a parameter's AccumulateGrad means the tensor is the parameter's data.
_PASS_THROUGH_NODES = frozenset(
    {
        "TBackward0",
        "TransposeBackward0",
        "TransposeBackward1",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SliceBackward0",
        "SelectBackward0",
        "AsStridedBackward0",
        "ToCopyBackward0",
        "CloneBackward0",
        "AliasBackward0",
        "DetachBackward0",
    }
)
_MAX_CHAIN = 8
#: the nodes a chain to a parameter goes through: a saved tensor whose ``grad_fn`` is
#: none of them (a compute node, the usual case) is not a parameter's data, which
#: ``Step._place`` tells without calling :func:`derives_from_parameter`
CHAIN_NODES = _PASS_THROUGH_NODES | {"AccumulateGrad"}

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_plain(t: torch.Tensor) -> bool:
    """True for ``torch.Tensor`` and ``nn.Parameter`` (not subclasses)."""
    return type(t) in _PLAIN_TYPES


def unsupported(t: torch.Tensor) -> bool:
    """Layouts whose bytes are not one strided storage (sparse, nested, quantized, ...)."""
    return t.layout != torch.strided or t.is_nested or t.is_quantized or t.is_meta


def span(t: torch.Tensor) -> tuple[int, int]:
    """``(start, end)`` in bytes of the storage region that ``t`` can address."""
    itemsize = t.element_size()
    offset = t.storage_offset()
    if t.is_contiguous():  # the common case: exactly its own elements
        return offset * itemsize, (offset * itemsize) + t.nbytes
    if t.numel() == 0:
        return offset * itemsize, offset * itemsize
    last = offset
    for size, stride in zip(t.shape, t.stride()):
        last += (size - 1) * stride
    return offset * itemsize, (last + 1) * itemsize


def as_bytes(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """A 1-D ``uint8`` view of bytes ``[start, end)`` of ``t``'s storage."""
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), start, (end - start,), (1,))


def rebuild(
    buffer: torch.Tensor,
    dtype: torch.dtype,
    size: torch.Size,
    stride: tuple[int, ...],
    byte_offset: int,
) -> torch.Tensor:
    """The tensor of ``dtype``/``size``/``stride`` at ``byte_offset`` into ``buffer``."""
    out = torch.empty(0, dtype=dtype, device=buffer.device)
    return out.set_(buffer.untyped_storage(), byte_offset // dtype.itemsize, size, stride)


def rebuild_view(
    buffer: torch.Tensor,
    dtype: torch.dtype,
    size: torch.Size,
    stride: tuple[int, ...],
    byte_offset: int,
) -> torch.Tensor:
    """:func:`rebuild` for tensors handed to autograd by an unpack hook (which
    re-wraps them, so that they are views of ``buffer`` does not show): the same
    elements, made as ``buffer.view(dtype).as_strided(...)`` when ``buffer`` is a 1-D
    ``uint8`` tensor at the start of its storage that holds whole elements, which is
    cheaper than a fresh tensor ``set_`` on the storage. ``as_strided`` checks the
    bounds against the storage as ``set_`` does."""
    itemsize = dtype.itemsize
    if (
        buffer.dtype != torch.uint8
        or buffer.numel() % itemsize
        or byte_offset % itemsize
        or buffer.storage_offset()
    ):
        return rebuild(buffer, dtype, size, stride, byte_offset)
    return buffer.view(dtype).as_strided(size, stride, byte_offset // itemsize)


def is_parameter_derived(
    t: torch.Tensor, state_storages: set[int], storage_ptr: int | None = None
) -> bool:
    """Whether ``t`` is a parameter (or buffer), shares its storage, or views/casts one.

    Args:
        t: the saved tensor.
        state_storages: ``data_ptr()`` of the untyped storages of the parameters and
            buffers of the layer being run.
        storage_ptr: ``t.untyped_storage().data_ptr()`` when the caller has it already.
    """
    if issubclass(type(t), torch.nn.Parameter):  # not isinstance: its metaclass is slow
        return True
    if storage_ptr is None:
        storage_ptr = t.untyped_storage().data_ptr()
    if storage_ptr in state_storages:
        return True
    return derives_from_parameter(t.grad_fn, state_storages)


def derives_from_parameter(fn: Any, state_storages: set[int]) -> bool:
    """The autograd half of :func:`is_parameter_derived`: whether the chain of
    view/cast nodes from ``fn`` (a saved tensor's ``grad_fn``) ends at a parameter's
    ``AccumulateGrad`` (or at a leaf on one of ``state_storages``)."""
    for _ in range(_MAX_CHAIN):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            var = fn.variable
            return issubclass(type(var), torch.nn.Parameter) or (
                var.untyped_storage().data_ptr() in state_storages
            )
        if name not in _PASS_THROUGH_NODES:
            return False
        nexts = fn.next_functions
        if not nexts:
            return False
        fn = nexts[0][0]
    return False


def is_te_quantized(t: torch.Tensor) -> bool:
    """TransformerEngine's saving protocol (TE >= 2.0: ``QuantizedTensor`` and the
    ``*TensorStorage`` / ``*TensorBase`` classes of Float8, MXFP8, blockwise and NVFP4):
    ``prepare_for_saving() -> (tensors, obj)`` and ``obj.restore_from_saved(tensors)``."""
    cls = type(t)
    return callable(getattr(cls, "prepare_for_saving", None)) and callable(
        getattr(cls, "restore_from_saved", None)
    )


def flatten(t: torch.Tensor) -> tuple[list[str], Any, list[torch.Tensor]] | None:
    """``(attribute names, context, inner tensors)`` of a wrapper subclass, else None."""
    flat = getattr(t, "__tensor_flatten__", None)
    if flat is None:
        return None
    names, ctx = flat()
    return list(names), ctx, [getattr(t, n) for n in names]


def unflatten(
    cls: type, names: list[str], ctx: Any, inner: list[torch.Tensor], size: Any, stride: Any
) -> torch.Tensor:
    """Rebuild a wrapper subclass from its (reloaded) inner tensors."""
    unflat: Callable[..., torch.Tensor] = cls.__tensor_unflatten__  # type: ignore[attr-defined]
    return unflat(dict(zip(names, inner)), ctx, size, stride)


def tensors_requiring_grad(
    obj: Any, out: list[torch.Tensor], depth: int = 0, max_depth: int = 3
) -> list[torch.Tensor]:
    """Tensors that require grad in a layer's inputs or outputs (a tensor, or tuples,
    lists and dicts of them, ``max_depth`` levels deep; a Hugging Face ``ModelOutput`` is
    a dict), appended to ``out`` in order."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif depth < max_depth:
        if isinstance(obj, (tuple, list)):
            for item in obj:
                tensors_requiring_grad(item, out, depth + 1, max_depth)
        elif isinstance(obj, dict):
            for item in obj.values():
                tensors_requiring_grad(item, out, depth + 1, max_depth)
    return out
