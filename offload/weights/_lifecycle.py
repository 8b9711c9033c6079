"""Life of one offloader's layers: install them (host copies, freed storages, hooks),
adopt a layer found while it runs (``get_cpu_offload_context``), and close (every
parameter back on the device, every hook removed, host memory returned)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload._core._device import backend_for
from offload._core._host_pool import HostBlock, HostPool, _next_pow2
from offload._core._warn import warn_at_caller
from offload.weights._hooks import _Hooks
from offload.weights._host_grads import NO_LIMIT, _HostGrads
from offload.weights._init import check_args, check_layers, check_shared, inspect_layer
from offload.weights._optim import track
from offload.weights._residency import _Layers, _WeightSlot
from offload.weights._state_dict import register as register_state_dict
from offload.weights._storage import allocate_blocks, copy_to_host

if TYPE_CHECKING:
    from offload.weights._init import _InspectedLayer

_MAX_SLAB = 256 << 20  # slabs of 256 MiB: several weights share one, little is wasted


def create(prefetch_layers: int, grads: str, pin_memory: bool) -> tuple[_Layers, _Hooks]:
    """Empty layers and their hooks, after checking the arguments."""
    check_args(prefetch_layers, grads, pin_memory)
    layers = _Layers(prefetch_layers, grads, pin_memory)
    track(layers)
    return layers, _Hooks(layers)


def populate(layers: _Layers, hooks: _Hooks, modules: Sequence[nn.Module]) -> None:
    """Install every layer of ``modules`` (``WeightOffloader.__init__``)."""
    distinct, every = check_layers(modules)
    found = []
    for i, module in distinct:
        layer = inspect_layer(i, module, layers.grads)
        if layer is not None:
            found.append(layer)
    if not found:
        raise ValueError(
            f"layers hold no parameters (all {len(distinct)} module(s) have none with "
            f"elements): nothing to offload"
        )
    check_shared(layers, found)
    _start(layers, found[0].device)
    total = sum(n for layer in found for _st, n, _ps in layer.stores.values())
    layers.pool = HostPool(
        NO_LIMIT, layers.pin_memory, min(_MAX_SLAB, _next_pow2(max(total, 1))), ahead=False
    )
    blocks = allocate_blocks(layers.pool, found, layers.pin_memory)
    for layer in found:
        hooks.register(_install(layers, layer, blocks, running=False), module_hooks=True)
    layers.sequence = [layers.modules[id(m)] for m in every if id(m) in layers.modules]


def _start(layers: _Layers, device: torch.device) -> None:
    if layers.backend is not None:
        return
    if device.type == "cpu" and torch.cuda.is_available():
        warn_at_caller(
            "offload: the parameters of `layers` are on the CPU, so WeightOffloader "
            "moves them from CPU memory to CPU memory and saves nothing. Move the "
            "model to the GPU first."
        )
    layers.device = device
    layers.backend = backend_for(device)
    layers.host_grads = _HostGrads(layers.backend, layers.grads == "host", layers.pin_memory)


def _install(
    layers: _Layers, layer: _InspectedLayer, blocks: dict[int, HostBlock], running: bool
) -> _WeightSlot:
    """Copy a layer's storages to the host, free them (unless the layer is running now:
    its forward hook frees them) and register its state-dict hooks."""
    stores, params = copy_to_host(layer, blocks)
    slot = _WeightSlot(len(layers.slots), layer.index, layer.module, layer.where, stores, params)
    for key, (_storage, _n, named) in layer.stores.items():
        layers.keys[key] = (slot, named[0][0])
    for prm in params:
        layers.owners[id(prm.param)] = slot
        if not prm.param.requires_grad:
            continue
        if not prm.fused:
            slot.expected.add(id(prm.param))
        if layers.grads == "host":
            _HostGrads.add_master(prm, layer.device)
    slot.versions = [prm.param._version for prm in params]
    slot.stream = layers.backend.current_stream()  # type: ignore[union-attr]
    layers.slots.append(slot)
    layers.resident_count += 1  # until the free below (or the end of the running call)
    layers.modules[id(layer.module)] = slot
    layers.order.append(slot)
    if running:  # adopted while it runs: the next call of the sequence
        layers.sequence.append(slot)
        layers.cursor = len(layers.sequence) - 1
        slot.fwd = 1
        slot.frames.append((sys.exc_info()[1], layers.cursor))
    else:
        layers.free(slot)
    register_state_dict(layers, slot)
    return slot


def adopt(layers: _Layers, hooks: _Hooks, module: nn.Module) -> _WeightSlot | None:
    """Offload ``module`` from inside its own first call (called by a global forward
    pre-hook): the weights are copied now and freed at the end of this call."""
    with layers.lock:
        layer = inspect_layer(len(layers.slots), module, layers.grads)
        if layer is None:
            return None
        check_shared(layers, [layer])
        _start(layers, layer.device)
        if layers.pool is None:
            layers.pool = HostPool(NO_LIMIT, layers.pin_memory, _MAX_SLAB, ahead=False)
        blocks = allocate_blocks(layers.pool, [layer], layers.pin_memory)
        slot = _install(layers, layer, blocks, running=True)
        hooks.register(slot, module_hooks=False)
        n = layers.prefetch_layers
        for s in layers.sequence[: max(0, len(layers.sequence) - n)]:
            if s.want_bwd and not s.bwd_active:  # no longer among the last n
                s.want_bwd = False
                layers.maybe_free(s)
        return slot


def close(layers: _Layers, hooks: _Hooks) -> None:
    """``WeightOffloader.close`` (not closed yet)."""
    worker_error = None
    if layers.host_grads is not None:
        try:
            layers.host_grads.drain()
        except RuntimeError as exc:
            worker_error = exc
    with layers.lock:
        layers.closed = True
        backend = layers.backend
        if backend is None:
            return
        stream = backend.current_stream()
        layers.host_grads.release_pending()  # type: ignore[union-attr]
        for slot in layers.slots:
            _HostGrads.drop_staging(slot)
            layers.make_resident(slot, stream)
            layers.wait_ready(slot, stream)
            for h in slot.hooks:
                h.remove()
            slot.hooks.clear()
        hooks.remove_calls()
        layers.owners = {}
        # The host slabs go now: wait until no copy reads them.
        backend.host_wait(backend.record(stream))
        backend.host_wait(layers.last_h2d)
        for slot in layers.slots:
            for st in slot.stores:
                st.block = None
                st.host = None
    layers.host_grads.close()  # type: ignore[union-attr]
    if layers.pool is not None:
        layers.pool.close()
    layers.pool = None
    if worker_error is not None:
        raise worker_error
