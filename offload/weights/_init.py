"""Checks made before a weight moves: the arguments of ``WeightOffloader``, each layer's
parameters (devices, layouts, storages a resize would damage, FSDP2), tied weights
between layers or with the rest of the model (FSDP2's ``_fsdp_init``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload._core import _packing

if TYPE_CHECKING:
    from offload.weights._residency import _Layers

GRADS = ("device", "host")


def check_args(prefetch_layers: Any, grads: Any, pin_memory: Any) -> None:
    """Raise on arguments of ``WeightOffloader`` of the wrong type or value."""
    if isinstance(prefetch_layers, bool) or not isinstance(prefetch_layers, int):
        raise TypeError(
            f"prefetch_layers must be an int >= 0; got {type(prefetch_layers).__name__} "
            f"{prefetch_layers!r}"
        )
    if prefetch_layers < 0:
        raise ValueError(f"prefetch_layers={prefetch_layers}: must be >= 0")
    if not isinstance(grads, str):
        raise TypeError(
            f"grads must be a str, one of {list(GRADS)}; got {type(grads).__name__} {grads!r}"
        )
    if grads not in GRADS:
        raise ValueError(f"grads={grads!r}: must be one of {list(GRADS)}")
    if not isinstance(pin_memory, bool):
        raise TypeError(
            f"pin_memory must be a bool; got {type(pin_memory).__name__} {pin_memory!r}"
        )


def check_layers(layers: Any) -> tuple[list[tuple[int, nn.Module]], list[nn.Module]]:
    """``(first position and module of each distinct module, every module in order)``."""
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"layers must be a sequence of nn.Module (the repeated blocks, e.g. model.layers "
            f"or offload.find_layers(model)); got a single {type(layers).__name__}"
        )
    if not isinstance(layers, (Sequence, nn.ModuleList, nn.Sequential)):
        raise TypeError(f"layers must be a sequence of nn.Module; got {type(layers).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; pass the modules whose weights to offload, in order")
    out: list[tuple[int, nn.Module]] = []
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers[{i}] must be an nn.Module; got {type(layer).__name__}")
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append((i, layer))
    return out, layers


class _InspectedLayer:
    """What :func:`inspect_layer` found in one layer, before anything moved."""

    __slots__ = ("index", "module", "where", "stores", "device", "named", "fused")

    def __init__(self, index: int, module: nn.Module, where: str) -> None:
        self.index = index
        self.module = module
        self.where = where
        # storage key -> (storage, nbytes, [(name, parameter)])
        self.stores: dict[int, tuple[torch.UntypedStorage, int, list[tuple[str, Any]]]] = {}
        self.device: torch.device | None = None
        self.named: list[tuple[str, nn.Parameter]] = []
        self.fused: set[int] = set()


def _fused_weights(module: nn.Module) -> set[int]:
    """ids of the weights whose gradient a fused layer writes into ``main_grad``
    (``offload.nn.Linear`` / ``GroupedLinear`` and TransformerEngine-style modules with
    ``fuse_wgrad_accumulation=True``): they get no ``.grad``."""
    ids: set[int] = set()
    for m in module.modules():
        if getattr(m, "fuse_wgrad_accumulation", False) is True:
            for name, p in m.named_parameters(recurse=False):
                if name.startswith("weight"):
                    ids.add(id(p))
    return ids


def _fsdp_message(where: str) -> str:
    return (
        f"{where} is managed by FSDP2 (fully_shard): its parameters are DTensor shards "
        f"that FSDP frees and all-gathers itself, so WeightOffloader cannot move them. "
        f"Use FSDP2's own offloading: fully_shard(module, "
        f"offload_policy=torch.distributed.fsdp.CPUOffloadPolicy())"
    )


def _check_not_fsdp(module: nn.Module, where: str) -> None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        FSDPModule = None  # noqa: N806
    for m in module.modules():
        if FSDPModule is not None and isinstance(m, FSDPModule):
            raise ValueError(_fsdp_message(where))
    for p in module.parameters():
        if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor":
            raise ValueError(_fsdp_message(where))


def _covered_bytes(params: list[torch.Tensor]) -> int:
    """Bytes of the storage addressed by ``params`` together (union of their spans)."""
    spans = sorted(_packing.span(p) for p in params)
    total, reach = 0, 0
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _check_param(
    p: nn.Parameter, what: str, where: str, layer: _InspectedLayer, grads: str
) -> None:
    if p.device.type == "meta":
        raise ValueError(f"{what} is on the meta device: materialise the model first")
    if p.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{what} is on {p.device}: only CUDA (and CPU) parameters can be offloaded"
        )
    if _packing.unsupported(p):
        raise ValueError(f"{what} has a layout that cannot be offloaded ({p.layout})")
    if layer.device is None:
        layer.device = p.device
    elif p.device != layer.device:
        raise ValueError(
            f"{what} is on {p.device}, others of {where} on {layer.device}: one "
            f"device per offloader"
        )
    if (
        grads == "host"
        and id(p) in layer.fused
        and p.requires_grad
        and getattr(p, "main_grad", None) is not None
    ):
        raise ValueError(
            f"{what} is the weight of a fused layer and already has a main_grad: "
            f"with grads='host' the offloader gives it a device staging main_grad "
            f"while the layer runs and the gradient ends in the host main_grad of "
            f"host_parameters(). Do not attach main_grad to offloaded layers, or "
            f"use grads='device'"
        )
    if not p.untyped_storage().resizable():
        raise ValueError(
            f"{what}: its storage cannot be resized (made from a numpy array or an "
            f"external buffer?); clone it into a regular tensor first"
        )


def inspect_layer(index: int, module: nn.Module, grads: str) -> _InspectedLayer | None:
    """Validate one layer; ``None`` when it has no parameter with elements."""
    where = f"layers[{index}] ({type(module).__name__})"
    _check_not_fsdp(module, where)
    layer = _InspectedLayer(index, module, where)
    layer.named = list(module.named_parameters(remove_duplicate=False))
    if not any(p.numel() for _, p in layer.named):
        return None
    layer.fused = _fused_weights(module)
    seen: set[int] = set()
    for name, p in layer.named:
        what = f"parameter {name!r} of {where}"
        if not _packing.is_plain(p):
            raise ValueError(
                f"{what} is a {type(p).__name__}, a tensor subclass: only plain "
                f"parameters can be offloaded"
            )
        if p.numel() == 0 or id(p) in seen:
            continue
        seen.add(id(p))
        _check_param(p, what, where, layer, grads)
        storage = p.untyped_storage()
        key = storage._cdata
        if key not in layer.stores:
            layer.stores[key] = (storage, storage.nbytes(), [])
        layer.stores[key][2].append((name, p))
    for _storage, nbytes, params in layer.stores.values():
        covered = _covered_bytes([p for _, p in params])
        if covered < nbytes:
            names = ", ".join(repr(n) for n, _ in params)
            raise ValueError(
                f"parameter(s) {names} of {where} live in a storage of {nbytes} bytes "
                f"of which they cover {covered}: the rest may belong to other tensors "
                f"(a flat parameter buffer), which freeing it would destroy"
            )
    return layer


def check_shared(layers: _Layers, found: list[_InspectedLayer]) -> None:
    """Raise if a storage of ``found`` is already offloaded, or is in two of them, or if
    they live on two devices."""
    owner = {key: (slot.where, name) for key, (slot, name) in layers.keys.items()}
    for layer in found:
        for key, (_st, _n, params) in layer.stores.items():
            name = params[0][0]
            if key in owner:
                other, other_name = owner[key]
                raise ValueError(
                    f"parameter {name!r} of {layer.where} shares its storage with "
                    f"parameter {other_name!r} of {other} (tied or shared weights): a "
                    f"weight used by two offloaded layers cannot be offloaded with "
                    f"either. Untie them, or leave one of the two layers out of `layers`"
                )
            owner[key] = (layer.where, name)
    devices = {layer.device for layer in found}
    if layers.device is not None:
        devices.add(layers.device)
    if len(devices) > 1:
        raise ValueError(
            f"the parameters of `layers` live on {sorted(map(str, devices))}: one "
            f"WeightOffloader per device"
        )


def check_tied(layers: _Layers, model: Any) -> None:
    """``WeightOffloader.check``: raise if a module of ``model`` outside the offloaded
    layers holds one of their storages."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"check() takes the model (an nn.Module); got {type(model).__name__}")
    inside: set[int] = set()
    for slot in layers.order:
        inside.update(id(m) for m in slot.module.modules())
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.numel() == 0 or not _packing.is_plain(p):
                continue
            hit = layers.keys.get(p.untyped_storage()._cdata)
            if hit is not None:
                slot, other = hit
                full = f"{name}.{pname}" if name else pname
                raise ValueError(
                    f"parameter {full!r} of the model is also parameter {other!r} of "
                    f"{slot.where}, which is offloaded: outside that layer it has no "
                    f"data on the device. Untie it, or leave that layer out of `layers`"
                )
