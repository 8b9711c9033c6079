"""What autograd keeps for each saved tensor: a handle, never the tensor itself.

A pack hook that returned its input would let a tensor saved by its own producer (exp,
sigmoid, softmax, SDPA's output) reference itself through its ``grad_fn``: a cycle only
the garbage collector can break. Every handle holds ``t.detach()`` instead (same storage,
same version counter) or, once offloaded, a reference to its host copy.

Handle kinds, cheapest first:

* :class:`Kept` -- stays on the device; its unpack checks the version counter, since
  autograd stops doing so once saved-tensor hooks are installed.
* :class:`Offloaded` -- bytes on the host (or on their way); its unpack reloads them if
  the schedule has not, and its death returns the host block (Note [release order], 7).
* :class:`Gathered` -- an :class:`Offloaded` small tensor whose bytes share one host
  block and one copy each way with the other small tensors of its layer call.
* :class:`Pending` -- saved between two layer calls; it becomes one of the above when
  the next group opens (or is kept when the forward ends).
* :class:`Held` -- manual mode (``get_cpu_offload_context(manual_synchronization=
  True)``): kept on the device until ``start_offload_layer`` turns it into one of the
  above; never started, it stays kept.
* :class:`PackedSubclass`, :class:`PackedQuantized`, :class:`Raw` -- wrapper tensor
  subclasses and TransformerEngine quantized tensors, whose parts are packed one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from offload import _dynamo, _packing

if TYPE_CHECKING:
    from offload._group import Group as _Group
    from offload._saves import _Bucket
    from offload._step import Step
    from offload._transfer import HostCopy as _Copy

__all__ = [
    "Held",
    "Gathered",
    "Kept",
    "Offloaded",
    "PackedQuantized",
    "PackedSubclass",
    "Pending",
    "Raw",
    "inplace_message",
    "unpack_hook",
]


def inplace_message(t: torch.Tensor, version: int) -> str:
    """Autograd's kind of error for a saved tensor changed in place after saving."""
    return (
        f"one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.dtype}{list(t.shape)}] is at version {t._version}; "
        f"expected version {version} instead (detected by offload: the tensor was saved "
        f"for backward and then changed in place)"
    )


class Kept:
    """A saved tensor that stays on the device."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(inplace_message(t, self.version))
        return t


class Offloaded:
    """A saved tensor whose bytes are (part of) a host copy.

    ``whole``: the tensor is its copy's whole geometry (``_Copy.spec``), so the reloaded
    buffer is the tensor; else it is rebuilt as a view into the reloaded span."""

    __slots__ = ("step", "group", "copy", "dtype", "size", "stride", "offset", "whole")

    def __init__(
        self,
        step: Step,
        group: _Group,
        copy: _Copy,
        dtype: torch.dtype,
        size: torch.Size,
        stride: tuple[int, ...],
        offset: int,
        whole: bool = False,
    ):
        self.step = step
        self.group = group
        self.copy = copy
        self.dtype = dtype
        self.size = size
        self.stride = stride
        self.offset = offset  # bytes from the start of the copied span
        self.whole = whole

    def unpack(self) -> torch.Tensor:
        buffer = self.step.reloaded_buffer(self)
        if self.whole:
            # a fresh tensor over the buffer (never the buffer itself: what the caller
            # does to the tensor's metadata must not reach the copy)
            return buffer.detach()
        return _packing.rebuild_view(buffer, self.dtype, self.size, self.stride, self.offset)

    def __del__(self) -> None:
        try:
            step = self.step
        except AttributeError:  # never initialised: its constructor did not run or raised
            return
        step.handle_died(self.copy, self.group)


class Gathered(Offloaded):
    """An :class:`Offloaded` small contiguous tensor whose bytes travelled in a bucket:
    one host block, one D2H and one H2D copy shared by the small tensors of one dtype
    saved together in a layer call (Note [release order], 1(b)). ``copy`` is the bucket
    (``_saves._Bucket``), ``index`` the tensor's number in it (its in-place poison
    is recorded under it) and ``offset`` its first element in the bucket (elements of
    ``dtype``, the bucket's).

    Hot path: once the bucket is reloaded and waited for (step 5 done), an unpack is
    one view of the reload buffer, made without the lock (a buffer dropped by another
    thread meanwhile stays valid: the view holds its storage)."""

    __slots__ = ("index",)

    def __init__(
        self,
        step: Step,
        group: _Group,
        copy: _Bucket,
        index: int,
        size: torch.Size,
        stride: tuple[int, ...],
        offset: int,
    ):
        # Offloaded.__init__'s assignments, inlined (the pack hot path)
        self.step = step
        self.group = group
        self.copy = copy
        self.dtype = copy.dtype
        self.size = size
        self.stride = stride
        self.offset = offset
        self.whole = False
        self.index = index

    def unpack(self) -> torch.Tensor:
        bucket: _Bucket = self.copy  # type: ignore[assignment]
        poisons = bucket.poisons
        if poisons is not None and self.index in poisons:
            raise RuntimeError(poisons[self.index])
        buffer = bucket.buffer
        if buffer is None or not bucket.waited:
            buffer = self.step.reloaded_buffer(self)
        # a fresh view of the reloaded bucket, never the bucket itself
        return buffer.as_strided(self.size, self.stride, self.offset)


class Pending:
    """Saved between two layer calls: decided when the next group opens."""

    __slots__ = ("inner",)

    def __init__(self, inner: Kept | Offloaded) -> None:
        self.inner = inner

    def unpack(self) -> torch.Tensor:
        return self.inner.unpack()


class Held(Pending):
    """Manual mode: on the device until its layer's ``start_offload_layer``. The group
    lists it by weak reference only (autograd owns it)."""

    __slots__ = ("__weakref__",)


class PackedSubclass:
    """A wrapper tensor subclass: its inner tensors are packed one by one."""

    __slots__ = ("cls", "names", "ctx", "parts", "size", "stride")

    def __init__(
        self, cls: type, names: list[str], ctx: Any, parts: list[Any], size: Any, stride: Any
    ):
        self.cls, self.names, self.ctx, self.parts = cls, names, ctx, parts
        self.size, self.stride = size, stride

    def unpack(self) -> torch.Tensor:
        inner = [p.unpack() for p in self.parts]
        return _packing.unflatten(self.cls, self.names, self.ctx, inner, self.size, self.stride)


class Raw:
    """A non-tensor attribute of a flattened subclass, kept by reference."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unpack(self) -> Any:
        return self.obj


class PackedQuantized:
    """A TransformerEngine quantized tensor: the object emptied by
    ``prepare_for_saving()`` and its data/scale tensors packed one by one."""

    __slots__ = ("obj", "parts")

    def __init__(self, obj: Any, parts: list[Any]) -> None:
        self.obj, self.parts = obj, parts

    def unpack(self) -> Any:
        tensors = [None if p is None else p.unpack() for p in self.parts]
        self.obj.restore_from_saved(tensors)  # fills the object in place
        return self.obj


def unpack_hook(handle: Any) -> torch.Tensor:
    """The unpack half of the saved-tensor hooks."""
    return handle.unpack()


_dynamo.opaque(unpack_hook)  # never a frame for dynamo (offload/_dynamo.py)
