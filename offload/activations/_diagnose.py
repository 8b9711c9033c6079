"""Messages that name the cause when the layers an offloader was given do not behave as
listed: the same module twice, layer calls out of the listed order, and saved-tensor
hooks pushed inside a layer that take its tensors away from the offloader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from offload._core._packing import tensors_requiring_grad
from offload.activations._handles import unpack_hook

__all__ = ["CallOrder", "saved_elsewhere"]


class CallOrder:
    """Each module's position in ``layers`` (listed once: ``ValueError`` otherwise), and
    which positions the forward in progress has called, to tell a list out of order (or
    a layer skipped) from a module called again (shared layers, which is fine)."""

    __slots__ = ("layers", "position", "called", "next")

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self.layers = layers
        self.position: dict[int, int] = {}
        for i, layer in enumerate(layers):
            first = self.position.setdefault(id(layer), i)
            if first != i:
                raise ValueError(
                    f"layers[{i}] is the same {type(layer).__name__} as layers[{first}]; "
                    f"list each module once (a module the forward calls several times "
                    f"makes one group per call)"
                )
        self.called: set[int] = set()
        self.next = 0  # the first position the forward has not called yet

    def check(self, call: int, module: torch.nn.Module) -> str | None:
        """Record layer call number ``call`` (0: a new forward) of ``module``; the
        warning when it skips over a listed layer not called yet, else None."""
        if call == 0:
            self.called.clear()
            self.next = 0
        position = self.position[id(module)]
        message = None
        if position > self.next:
            expected = self.layers[self.next]
            message = (
                f"offload: the forward's layer calls do not follow the order of `layers`: "
                f"call {call} ran layers[{position}] ({type(module).__name__}) before "
                f"layers[{self.next}] ({type(expected).__name__}) was called (listed out "
                f"of order, or skipped). offload_layers, prefetching and stats count layer "
                f"calls in the order they run; list the layers in the order the forward "
                f"calls them."
            )
        self.called.add(position)
        while self.next in self.called:
            self.next += 1
        return message


def saved_elsewhere(index: int, module: torch.nn.Module, output: Any) -> str | None:
    """Layer call ``index``, selected for offloading, saved nothing through the
    offloader's hooks. If the graph behind its outputs holds tensors saved by other
    saved-tensor hooks, those were pushed inside the layer (or around it) and took every
    tensor saved while active, since saved-tensor hooks do not nest: the warning naming
    them. None when the layer simply saved nothing (or grad is off)."""
    if not torch.is_grad_enabled():
        return None
    outputs = tensors_requiring_grad(output, [])
    hook = _foreign_unpack_hook(outputs) if outputs else None
    if hook is None:
        return None
    name = "not identified"
    if hook is not ...:
        # save_on_cpu.__init__.<locals>.unpack_from_cpu -> save_on_cpu
        where = str(getattr(hook, "__qualname__", hook)).split(".<locals>")[0]
        name = f"{getattr(hook, '__module__', '?')}.{where.removesuffix('.__init__')}"
    return (
        f"offload: layer call {index} ({type(module).__name__}) was selected for "
        f"offloading, but none of the tensors it saved for backward reached the "
        f"offloader: saved-tensor hooks pushed inside the layer (torch.autograd.graph."
        f"save_on_cpu, torch.utils.checkpoint or offload.checkpoint, another library's "
        f"saved_tensors_hooks; here: {name}) take every tensor saved while they are "
        f"active, since saved-tensor hooks do not nest. Remove that hook from the "
        f"layer, or leave the layer out of offload_layers (a checkpointed layer: "
        f"offload.checkpoint already keeps its inputs in host memory)."
    )


def _foreign_unpack_hook(outputs: list[torch.Tensor], limit: int = 256) -> Any:
    """The unpack hook of another pair of saved-tensor hooks that saved a tensor of the
    graph behind ``outputs`` (its first ``limit`` nodes); ``...`` when a tensor is saved
    there but this torch cannot tell by which hooks (``SavedTensor.unpack_hook`` is
    recent); None when neither."""
    seen: set[Any] = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    unknown = False
    while todo and len(seen) < limit:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_raw_saved_"):
                continue
            saved = getattr(node, attr, None)
            for one in saved if isinstance(saved, (list, tuple)) else (saved,):
                if not isinstance(one, torch._C._autograd.SavedTensor):
                    continue
                if not hasattr(one, "unpack_hook"):
                    unknown = True
                    continue
                hook = one.unpack_hook
                if hook is not None and hook is not unpack_hook:
                    return hook
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return ... if unknown else None
