"""State-dict hooks of offloaded layers: ``state_dict()`` returns views of the host copies
(complete while the device storage is empty), ``load_state_dict()`` fills each layer on
the device while it loads and writes it back to the host."""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from offload.weights._hooks import lazy_eager
from offload.weights._storage import host_view

if TYPE_CHECKING:
    from offload.weights._residency import _Layers, _WeightSlot


def _state_dict_post(
    ref: weakref.ref, index: int, module: nn.Module, state_dict: Any, prefix: str, meta: Any
) -> None:
    layers = ref()
    if layers is not None and not layers.closed:
        _fill(layers, layers.slots[index], state_dict, prefix)


def _load_pre(
    ref: weakref.ref,
    index: int,
    module: nn.Module,
    state_dict: Any,
    prefix: str,
    meta: Any,
    *rest: Any,
) -> None:
    layers = ref()
    if layers is not None and not layers.closed:
        if meta is not None and meta.get("assign_to_params_buffers", False):
            raise RuntimeError(
                "offload: load_state_dict(assign=True) would replace the parameters of an "
                "offloaded layer; call WeightOffloader.close() first, or load with "
                "assign=False (the default)"
            )
        layers.hold(layers.slots[index])


def _load_post(ref: weakref.ref, index: int, module: nn.Module, incompatible: Any) -> None:
    layers = ref()
    if layers is not None and not layers.closed:
        layers.unhold(layers.slots[index])


def _fill(layers: _Layers, slot: _WeightSlot, state_dict: Any, prefix: str) -> None:
    """Offloaded parameters as views of their host copies, brought up to date first."""
    with layers.lock:
        slot.sync_host(layers.backend)  # type: ignore[arg-type]
        for prm in slot.params:
            view = None
            for name in prm.names:
                key = prefix + name
                if key in state_dict:
                    if view is None:
                        view = host_view(prm)
                    state_dict[key] = view


def register(layers: _Layers, slot: _WeightSlot) -> None:
    """Add the state-dict hooks of ``slot``'s module to ``slot.hooks``; they hold
    ``layers`` weakly, so the model does not keep the offloader alive."""
    ref, i, m = layers.ref, slot.sid, slot.module
    slot.hooks.append(
        m.register_state_dict_post_hook(functools.partial(lazy_eager(_state_dict_post), ref, i))
    )
    slot.hooks.append(
        m.register_load_state_dict_pre_hook(functools.partial(lazy_eager(_load_pre), ref, i))
    )
    slot.hooks.append(
        m.register_load_state_dict_post_hook(functools.partial(lazy_eager(_load_post), ref, i))
    )
