"""Where one saved tensor goes: kept on the device (and why) or copied to the host.

Called by the scheduler for every tensor saved inside an offloaded group; the reasons
are the ``bytes_kept`` keys of :class:`offload.OffloadStats`. Pure decisions: no
copies, no state beyond what the layer's parameters say.
"""

from __future__ import annotations

from typing import Any

import torch

from offload._core import _packing

__all__ = ["LayerState", "layer_state", "marked", "parameter_like"]


class LayerState:
    """What a layer's parameters and buffers look like during one forward.

    ``storages``: ``data_ptr()`` of their untyped storages (a saved tensor on one of
    them is the parameter itself or a view of it, e.g. ``nn.Linear``'s ``weight.t()``).
    ``frozen_shapes``: shapes of parameters that do not require grad, and of their 2-D
    transposes (a saved tensor with one of these shapes, no ``grad_fn`` and no
    ``requires_grad`` is a cast of a frozen weight, e.g. autocast's ``weight.to(bf16)``
    of a LoRA base weight, which gets fresh storage every call).
    """

    __slots__ = ("storages", "frozen_shapes")

    def __init__(self, storages: set[int], frozen_shapes: set[tuple[int, ...]]) -> None:
        self.storages = storages
        self.frozen_shapes = frozen_shapes


_EMPTY = LayerState(set(), set())


def layer_state(module: torch.nn.Module | None) -> LayerState:
    """The :class:`LayerState` of ``module`` now (parameters may move between steps:
    FSDP2 re-gathers them, so this is computed once per group and forward)."""
    if module is None:
        return _EMPTY
    storages: set[int] = set()
    frozen: set[tuple[int, ...]] = set()
    for t in _tensors(module):
        if t is None:
            continue
        if not t.requires_grad:
            shape = tuple(t.shape)
            frozen.add(shape)
            if len(shape) == 2:
                frozen.add(shape[::-1])
        if not _packing.is_plain(t):  # DTensor (FSDP2 sharded, TP): its local shard
            t = getattr(t, "_local_tensor", None)
            if t is None:
                continue
        storages.add(t.untyped_storage().data_ptr())
    storages.discard(0)
    return LayerState(storages, frozen)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor | None]:
    """The parameters and buffers of ``module`` and its submodules, as
    ``module.parameters()`` and ``module.buffers()`` give them, without their generators
    (a few times faster: this runs once per offloaded layer call). May hold ``None``
    (an unset parameter), and a tensor or module registered twice appears twice: the
    caller skips the first and collects sets."""
    out: list[torch.Tensor | None] = []
    seen: set[int] = set()
    stack: list[torch.nn.Module | None] = [module]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))  # a module among its own descendants would loop
        out += m._parameters.values()
        out += m._buffers.values()
        stack += m._modules.values()
    return out


def marked(t: torch.Tensor) -> bool:
    """A tensor flagged ``_TE_do_not_offload`` or ``_do_not_offload``."""
    d = t.__dict__
    return bool(d) and bool(d.get("_TE_do_not_offload") or d.get("_do_not_offload"))


def parameter_like(t: torch.Tensor, state: LayerState, storage_ptr: int | None = None) -> bool:
    """Whether ``t`` is a parameter in disguise: a parameter or buffer, a tensor on
    one's storage, a view/cast chain back to one (``_packing.is_parameter_derived``), or
    a cast of a frozen weight (see :class:`LayerState`). ``storage_ptr``:
    ``t.untyped_storage().data_ptr()`` when the caller has it already.
    ``Step._place`` inlines this test: change both together."""
    # _packing.is_parameter_derived, unrolled (this runs for every saved tensor)
    if issubclass(type(t), torch.nn.Parameter):
        return True
    if storage_ptr is None:
        storage_ptr = t.untyped_storage().data_ptr()
    storages = state.storages
    if storage_ptr in storages:
        return True
    fn = t.grad_fn
    if fn is not None:
        return _packing.derives_from_parameter(fn, storages)
    frozen = state.frozen_shapes
    return not t.requires_grad and bool(frozen) and tuple(t.shape) in frozen


def kept_bytes(t: torch.Tensor) -> int:
    """Bytes a kept tensor accounts for: its elements (``numel * itemsize``)."""
    try:
        return t.nbytes
    except RuntimeError:  # sparse, nested: not one strided block
        try:
            return t.numel() * t.element_size()
        except RuntimeError:
            return 0


def summary_hint(reason: str) -> str:
    """What to change when everything a selected layer saved was kept for ``reason``."""
    return _HINTS.get(reason, "")


_HINTS: dict[str, Any] = {
    "small": "lower min_tensor_bytes (each saved tensor was below it)",
    "parameter": "the layers only saved parameters (nothing to offload)",
    "filtered": "tensor_filter returned False for every tensor",
    "host_limit": "raise host_memory_limit",
    "opted_out": "the layers ran inside offload.no_offload()",
    "unsupported": "the saved tensors have layouts that cannot be copied (sparse, nested)",
    "device": "the saved tensors live on another device than the first one seen",
}
