"""The offloader's per-layer hooks: where a layer call opens and closes its group,
and where a forward that offloads nothing stops tracking (Note [untracked calls])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from offload._core import _context
from offload._core._units import format_bytes
from offload._core._warn import warn_at_caller
from offload.activations._diagnose import saved_elsewhere

if TYPE_CHECKING:
    from collections.abc import Callable

    from offload._core._runtime import Runtime
    from offload.activations._attach import LayerHooks
    from offload.activations._auto._policy import AutoPolicy
    from offload.activations._diagnose import CallOrder
    from offload.activations._recompute_calls import RecomputedCalls
    from offload.activations._step import Step

__all__ = ["LayerCalls"]

#: the thread-local behind ``_context.owner()``, read directly in the per-layer hooks
_ACTIVE = _context.active

#: ``(pack, unpack)`` of the innermost saved-tensor hooks of the thread, or None (private:
#: no public API tells; _hooks_on_top falls back when it is missing)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


# Note [untracked calls]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A forward whose plan offloads no call at all (``Schedule.offloads_nothing``:
# ``offload_layers=0``, or "auto" choosing no layer, its verifying steps included) has
# nothing to place, release or reload, so after its first layer call it stops tracking:
# the first call is a group as usual (the auto watch times the step from its start and
# its backward), then our saved-tensor hooks stay off until the forward ends. Module
# hooks cost a launch-bound model even when they do nothing (a hooked module call takes
# PyTorch's slow path), so a forward expected to offload nothing (the plan says so, or
# the last forward was untracked) hooks only its first layer (``LayerHooks.partial``);
# the later calls are taken to be the last forward's. Should the first call's plan
# offload after all, the other layers are hooked before the second call. Hooks held by
# an attachment stay on every layer; a later call then only appends its module to
# ``Step.untracked``. Not for a measuring forward (it counts every layer's saves),
# a CUDA graph capture or manual mode (they drive groups themselves), nor when other
# saved-tensor hooks sit above ours. Saves made after the first call are then not counted
# in ``bytes_kept``. The first layer called again after a whole forward starts the
# next forward, with our hooks back on.


def _untracked_after_first(step: Step) -> bool:
    """Whether ``step``'s first layer call, just ending (not nested) with our hooks
    aside, ends its tracking (Note [untracked calls])."""
    return (
        step.plan.offloads_nothing and not step.probe and step.capture is None and not step.manual
    )


def _hooks_on_top(saved_hooks: Any) -> bool:
    """Whether our saved-tensor hooks are the innermost on this thread (only then
    may they be popped: hooks pushed inside ``with offloader:`` by the caller, e.g.
    non-reentrant checkpointing around a layer, must stay). PyTorch has no public
    way to ask; without the private one, the hooks stay (correct, only slower)."""
    top = _TOP_HOOKS
    if top is None or saved_hooks is None:
        return False
    current = top(False)
    return current is not None and current[0] is saved_hooks.pack_hook


if TYPE_CHECKING:

    class _OffloaderState:
        """The state of the offloader that :class:`LayerCalls` is a part of, for the type checker."""

        _step: Step | None
        _layers: list[torch.nn.Module]
        _layer_hooks: LayerHooks
        _saved_hooks: Any
        _warned: set[str]
        _aside: bool
        _runtime: Runtime
        _calls: list[Any]
        _recomputed: RecomputedCalls
        _call_bytes: int
        _last_call_bytes: int
        _first_recomputed: bool
        _order: CallOrder
        _auto: AutoPolicy | None
        _new_step: Callable[[], Step]
        _end_forward: Callable[[Step], None]
        _warn_once: Callable[[str, str], None]

else:
    _OffloaderState = object


class LayerCalls(_OffloaderState):
    """The forward pre-hook and forward hook that :class:`offload.ActivationOffloader`
    puts on each of its layers (a part of it, whose state they use)."""

    def _layer_start(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        step = self._step
        if step is None or _ACTIVE.owner is not self:
            # outside a forward, or a call made on another thread (a second offloader
            # over the same modules, data-parallel replicas): not ours
            return
        groups = step.groups
        untracked = step.untracked
        if untracked is not None:  # Note [untracked calls]
            if step.untracked_depth:
                step.untracked_depth += 1
                return
            if module is not groups[0].module or (
                len(untracked) + 1 < len(self._layers) and not self._layer_hooks.partial
            ):
                untracked.append(module)
                step.untracked_depth = 1
                return
            if self._aside:  # the next forward starts with our hooks on
                self._saved_hooks.__enter__()
                self._aside = False
            self._end_forward(step)
            step = self._new_step()
        elif step.open is None and len(groups) >= len(self._layers) and module is groups[0].module:
            # The first layer again after a whole forward: the next forward (another
            # micro-batch) in the same context entry. It gets its own plan, so the
            # calls offloaded do not depend on how many forwards an entry holds.
            self._end_forward(step)
            step = self._new_step()
        if self._auto is not None and not step.groups:
            self._auto.prepare(self, step, (args, kwargs))
        if step.open is None and "order" not in self._warned:
            message = self._order.check(len(step.groups), module)
            if message is not None:
                self._warn_once("order", message)
        step.open_group(module, (args, kwargs))
        group = step.open
        if (
            group is not None
            and not group.offload
            and step.depth == 0
            and not step.counts
            and not self._aside
            and _hooks_on_top(self._saved_hooks)
        ):
            # A layer call that is not offloaded runs without our saved-tensor hooks:
            # every tensor it saves would be kept anyway, and a Python hook per saved
            # tensor is what a launch-bound model pays for. Autograd then saves them
            # itself (with its own in-place checks); they are not counted in the stats.
            self._saved_hooks.__exit__(None, None, None)
            self._aside = True

    def _layer_end(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        step = self._step
        if step is not None and _ACTIVE.owner is self:
            if step.untracked is not None:  # Note [untracked calls]
                if step.untracked_depth:
                    step.untracked_depth -= 1
                return
            group = step.open if step.depth == 0 else None
            if group is not None and group.index == 0:
                if self._aside and _untracked_after_first(step):
                    step.untracked = []  # our saved-tensor hooks stay off
                else:
                    self._layer_hooks.add_rest()
            if self._aside and step.depth == 0 and step.untracked is None:
                self._saved_hooks.__enter__()
                self._aside = False
            step.close_group(output)
            if group is not None:
                if group.offload and not group.stats.recomputed:
                    self._call_bytes = max(self._call_bytes, group.stats.bytes_offloaded)
                self._before_call(step, group.index + 1)
            if (
                group is not None
                and group.offload
                and not group.stats.bytes_offloaded
                and group.deferred is None  # placed later (Note [release order], 1(c))
            ):
                if "saved_elsewhere" not in self._warned:
                    self._check_saved_elsewhere(step, group, module, output)

    def _before_call(self, step: Step, index: int) -> None:
        """Settle whether call ``index`` of ``step`` runs recomputed, before it starts
        (Note [recomputed calls]): planned so, or an offloaded call whose saves the host
        budget is predicted not to hold (the most one call sent, this forward or the
        last), on the scheduled eager path."""
        calls = self._calls
        if index >= len(calls):
            return
        plan = step.plan
        want = index in plan.recomputed or (index == 0 and self._first_recomputed)
        if not want and index in plan.offloaded and not step.manual and step.capture is None:
            want = self._host_short(index)
        if want or len(self._recomputed):
            step.recompute_next = self._recomputed.set(calls[index], want)

    def _host_short(self, index: int) -> bool:
        pool = self._runtime._pool
        need = self._call_bytes or self._last_call_bytes
        if pool is None or not need or pool.in_use_bytes + need <= pool.limit:
            return False
        if "host_recompute" not in self._warned:
            self._warn_once(
                "host_recompute",
                f"host_memory_limit: the host pool holds {format_bytes(pool.in_use_bytes)} "
                f"of {format_bytes(pool.limit)} and a layer call sends up to "
                f"{format_bytes(need)}: layer call {index} and later ones that do not fit "
                "run recomputed (torch's non-reentrant checkpoint), only their inputs "
                "offloaded. Raise host_memory_limit (host RAM permitting) to offload them "
                "instead.",
            )
        return True

    def _check_saved_elsewhere(self, step: Step, group: Any, module: Any, output: Any) -> None:
        """Warn once when an offloaded layer saved nothing through our hooks: whose were
        its saves? (One look only: it walks the autograd graph.)"""
        stats = group.stats
        if step.probe or stats.bytes_offloaded or any(stats.bytes_kept.values()):
            return
        if torch.is_grad_enabled():
            self._warned.add("saved_elsewhere")
            message = saved_elsewhere(group.index, module, output)
            if message is not None:
                self._saved_elsewhere = True
                warn_at_caller(message)
