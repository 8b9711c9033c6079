"""The optimizer guard: one global optimizer step pre-hook that refuses a step over
offloaded parameters that have a gradient but no data on the device (it would read empty
storages: PyTorch does not check, and the process may crash)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from offload._core._dynamo import eager

if TYPE_CHECKING:
    from offload.weights._residency import _Layers

#: The layers of live offloaders.
_LIVE: weakref.WeakSet[_Layers] = weakref.WeakSet()
_GUARD: list[Any] = []


def track(layers: _Layers) -> None:
    """Guard ``layers`` from now on (installs the hook once per process)."""
    _LIVE.add(layers)
    if not _GUARD:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _GUARD.append(register_optimizer_step_pre_hook(eager(_optimizer_guard)))


def _optimizer_guard(optimizer: Any, args: Any, kwargs: Any) -> None:
    for layers in list(_LIVE):
        owners = layers.owners
        if layers.closed or not owners:
            continue
        for group in optimizer.param_groups:
            for p in group["params"]:
                slot = owners.get(id(p))
                # parameters without a gradient are skipped by the step (a frozen base)
                if slot is not None and not slot.resident and p.grad is not None:
                    raise RuntimeError(
                        f"offload: {type(optimizer).__name__}.step() over a parameter of "
                        f"{slot.where}, whose weights are offloaded (no data on the device "
                        f"outside its layer). Step inside `with offloader.resident():` "
                        f"(grads='device'), or step a CPU optimizer on "
                        f"offloader.host_parameters() and call offloader.push() "
                        f"(grads='host')"
                    )
