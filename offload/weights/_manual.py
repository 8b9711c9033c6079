"""The weights side of ``get_cpu_offload_context(..., offload_weights=True)``: the modules
run inside the first ``num_layers`` groups of a forward are adopted, at their first call,
by one :class:`offload.WeightOffloader`."""

from __future__ import annotations

from typing import Any

from torch import nn

from offload._core._dynamo import eager
from offload.weights._front import WeightOffloader
from offload.weights._lifecycle import adopt
from offload.weights._residency import _WeightSlot


class _ManualWeights:
    """The context of ``get_cpu_offload_context(..., offload_weights=True)``.

    Each ``with`` entry is one group, as for activations; the modules called at the top
    level inside the first ``num_layers`` groups of a forward are offloaded by one
    :class:`WeightOffloader` (``self.weights``), adopted at their first call (found
    with global module hooks that exist only while such an entry is open). From then on
    they behave as if given to ``WeightOffloader`` in call order, inside or outside the
    context. ``inner`` is the activation context (or a null context).
    """

    def __init__(self, inner: Any, sync: Any, num_layers: int, model_layers: int) -> None:
        self._inner = inner
        self._sync = sync
        self.num_layers = num_layers
        self.model_layers = model_layers
        self.weights = WeightOffloader._empty()
        self._entries = 0
        self._hooks: list[Any] = []
        self._depth = 0
        self._adopted: list[tuple[nn.Module, _WeightSlot]] = []

    def __enter__(self) -> _ManualWeights:
        group = self._entries % self.model_layers
        self._entries += 1
        self._inner.__enter__()
        if group < self.num_layers:
            from torch.nn.modules.module import (
                register_module_forward_hook,
                register_module_forward_pre_hook,
            )

            self._depth = 0
            self._hooks = [
                register_module_forward_pre_hook(self._pre),
                register_module_forward_hook(self._post, always_call=True),
            ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._inner.__exit__(*exc)

    @eager
    def _pre(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        layers = self.weights._layers
        if self._depth == 1 and id(module) not in layers.modules and not layers.closed:
            slot = adopt(layers, self.weights._hooks, module)
            if slot is not None:
                self._adopted.append((module, slot))

    @eager
    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._adopted and self._adopted[-1][0] is module:
            _module, slot = self._adopted.pop()
            hooks = self.weights._hooks
            hooks.forward_end(slot, args, {}, output)
            hooks.register_forward(slot)  # its later calls: module hooks

    def sync(self, output: Any) -> Any:
        return self._sync(output)

    def __getattr__(self, name: str) -> Any:  # the activation context's stats, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def manual_weight_context(
    activations: tuple[Any, Any], num_layers: int, model_layers: int
) -> tuple[Any, Any]:
    """``(context, sync)`` for ``get_cpu_offload_context(..., offload_weights=True)``:
    ``activations`` is the pair the activation side returned (a null context and the
    identity when activations are not offloaded); the weights of the modules run in the
    first ``num_layers`` groups of each forward are offloaded."""
    ctx = _ManualWeights(activations[0], activations[1], num_layers, model_layers)
    return ctx, ctx.sync
