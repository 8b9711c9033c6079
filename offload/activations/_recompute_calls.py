"""Layer calls that an activation offloader runs recomputed, their inputs offloaded.

When host memory cannot hold a call's saves, or device memory forces more than the link
hides, the offloader runs the call under torch's non-reentrant checkpoint instead of
keeping its saves on the device: the checkpoint saves only the call's inputs, which go
through the offloader's saved-tensor hooks like any offloaded save, and the backward
recomputes the rest (Note [recomputed calls]).

Note [recomputed calls]
~~~~~~~~~~~~~~~~~~~~~~~
A module's ``forward`` is looked up before its forward pre-hooks run, so whether a call
is recomputed is settled before the call starts: at the offloader's entry for the first
call, at the close of call ``i`` for call ``i + 1``. The switch is a wrapper installed
as the module's instance attribute ``forward`` the first time it is needed, inactive
outside the offloader's context (a call then goes straight to the original forward)
and removed by ``close()``. The checkpoint's recompute in the backward calls the
original forward, outside the context, so no hook of ours runs there. A recomputed call
belongs to the plan's offloaded groups: its inputs leave the device when the next call
starts and come back one call ahead of its backward; the release rule of Note [release
order] counts only the other offloaded groups (``offload.activations._schedule.make_plan``), so a
recomputed call never makes them leave earlier than they would without it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

__all__ = ["RecomputedCalls"]


class _Forward:
    """The wrapper installed as ``module.forward`` (Note [recomputed calls]). It holds
    its module weakly: a module whose instance attribute points at it would otherwise
    form a cycle that only the garbage collector frees."""

    __slots__ = ("__weakref__", "active", "had_attr", "module", "previous")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)
        self.had_attr = "forward" in module.__dict__
        self.previous = module.__dict__.get("forward")  # someone else's, called as is
        self.active = False

    def _inner(self) -> Any:
        module = self.module()
        if module is None:
            raise RuntimeError("the module of a recomputed layer call was freed")
        if self.had_attr:
            return self.previous
        return functools.partial(type(module).forward, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner()
        if self.active and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    def remove(self) -> None:
        module = self.module()
        if module is not None and module.__dict__.get("forward") is self:
            if self.had_attr:
                module.forward = self.previous
            else:
                del module.forward


class RecomputedCalls:
    """The wrappers of one offloader, by module (Note [recomputed calls])."""

    def __init__(self) -> None:
        self._wrappers: dict[int, _Forward] = {}

    def set(self, module: Any, active: bool) -> bool:
        """Make the next call of ``module`` recomputed (``active``) or plain; returns
        whether it will be recomputed. A module whose ``forward`` was replaced by
        someone else after our wrapper was installed is left alone (plain)."""
        if not isinstance(module, torch.nn.Module):
            return False
        wrapper = self._wrappers.get(id(module))
        if wrapper is None:
            if not active:
                return False
            wrapper = self._wrappers[id(module)] = _Forward(module)
            module.forward = wrapper
        if module.__dict__.get("forward") is not wrapper:
            wrapper.active = False
            return False
        wrapper.active = active
        return active

    def deactivate(self) -> None:
        """Every call plain again (the context exited)."""
        for wrapper in self._wrappers.values():
            wrapper.active = False

    def remove(self) -> None:
        """Restore every module's ``forward`` (idempotent)."""
        for wrapper in self._wrappers.values():
            wrapper.remove()
        self._wrappers.clear()

    def __len__(self) -> int:
        return len(self._wrappers)
