"""The manual context of :func:`offload.get_cpu_offload_context`: one ``with`` entry per
group, the :class:`ManualOffloadSynchronizer` that starts, releases and reloads each
group when the caller says, and the pruning of forwards whose backward has run."""

from __future__ import annotations

from typing import Any, cast

import torch

from offload._core import _context, _device
from offload._core._runtime import Runtime
from offload.activations._handles import unpack_hook
from offload.activations._schedule import Schedule, plan_forward
from offload.activations._step import Step
from offload.config import OffloadConfig
from offload.stats import OffloadStats

__all__ = ["ManualOffloadSynchronizer"]


class _ManualContext:
    """One ``with`` entry = one group; ``model_layers`` entries make one forward.

    ``manual=True`` (``manual_synchronization=True``): every group is held for the
    :class:`ManualOffloadSynchronizer`; nothing is released or reloaded on a schedule."""

    def __init__(
        self,
        num_layers: int,
        model_layers: int,
        config: OffloadConfig,
        *,
        manual: bool = False,
        offload_stream: Any = None,
        retain_pinned_cpu_buffers: bool = False,
    ) -> None:
        self.num_layers = num_layers
        self.model_layers = model_layers
        self.runtime = Runtime(
            config, offload_stream=offload_stream, retain_host=retain_pinned_cpu_buffers
        )
        self.config = config
        self.manual = manual
        self.step: Step | None = None
        self.forwards = 0  # forwards started so far; the latest is number forwards - 1
        #: manual mode: the forwards the synchronizer can still name, by number
        self.by_number: dict[int, Step] = {}
        self._unfinished: list[Step] = []
        self._hooks: Any = None

    def _new_forward(self) -> Step:
        if self.manual:
            n = self.model_layers
            every = frozenset(range(n))
            plan = Schedule(n, every, {}, {}, lambda i, m: True)  # no release, no reload point
        else:
            plan = plan_forward(
                self.num_layers, [None] * self.model_layers, self.config.prefetch_layers
            )
        step = self.step = Step(self.runtime, plan)
        if _device.capturing():
            step.capture = "step"
        if self.manual:
            step.manual = True
            self.by_number = {k: v for k, v in self.by_number.items() if not _forward_over(v)}
            self.by_number[self.forwards] = step
        self.forwards += 1
        return step

    def __enter__(self) -> _ManualContext:
        _context.claim(self, "get_cpu_offload_context() context")
        try:
            step = self.step
            if step is None or len(step.groups) >= self.model_layers:
                # A new forward: hooks of earlier forwards whose backward ran go now.
                if step is not None:
                    self._unfinished.append(step)
                self._unfinished = _prune(self._unfinished)
                step = self._new_forward()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(step.pack, unpack_hook)
            self._hooks.__enter__()
            step.open_group(None)
        except BaseException:
            hooks, self._hooks = self._hooks, None
            if hooks is not None:
                hooks.__exit__(None, None, None)
            _context.release(self)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        step = cast(Step, self.step)  # set by __enter__
        try:
            if exc_type is not None:
                step.abort()
                self.step = None
                return
            step.close_group()
            if len(step.groups) >= self.model_layers:
                step.finish_forward()
        finally:
            hooks, self._hooks = self._hooks, None
            _context.release(self)
            hooks.__exit__(exc_type, exc, tb)

    def sync(self, output: Any) -> Any:
        """Mark the end of the group just closed; returns ``output`` unchanged."""
        step = self.step
        if step is not None and step.groups:
            step.register_trigger(len(step.groups) - 1, output)
        return output

    @property
    def stats(self) -> OffloadStats:
        step = self.step
        return OffloadStats() if step is None else step.read_stats()


def _forward_over(step: Step) -> bool:
    """A manual-mode forward with nothing left to move: it ended, and no tensor it saved
    is alive (its backward ran, its graph was freed, or nothing it saved qualified)."""
    if step.aborted:
        return True
    if not step.forward_done:
        return False
    for g in step.groups:
        if g.live or g.device_refs or any(ref() is not None for ref, *_ in g.held):
            return False
    return True


_PHASE_NEEDED = {
    "start_offload_layer": ("saved", "no offload was started for it"),
    "release_activation_forward_gpu_memory": (
        "offload_started",
        "start_offload_layer was called for it and it was not released yet",
    ),
    "start_reload_layer": (
        "released",
        "release_activation_forward_gpu_memory was called for it and no reload started",
    ),
}


class ManualOffloadSynchronizer:
    """The third value of ``get_cpu_offload_context(..., manual_synchronization=True)``:
    the caller decides when each layer's activations are copied out, freed on the device
    and brought back (TransformerEngine's ``ManualOffloadSynchronizer``).

    In this mode every save of a layer stays on the device (counted ``not_selected``)
    until :meth:`start_offload_layer` names the layer; a layer never named is never
    offloaded. Then, per layer and forward, in this order and once each:

    1. :meth:`start_offload_layer` -- allocate host blocks for its saves and issue their
       device-to-host copies (after the work queued so far on the compute stream);
       record the event that marks their end.
    2. :meth:`release_activation_forward_gpu_memory` -- the compute stream waits for
       that event (the host does not), then the device references are dropped: the
       caching allocator may reuse the blocks for later kernels, which run behind the
       wait.
    3. :meth:`start_reload_layer` -- issue the host-to-device copies into fresh buffers;
       each saved tensor's first unpack in the backward makes the compute stream wait
       for its copy.

    Skipping step 2 keeps the device copies (its saves are then reloaded on demand if
    step 3 is skipped too); skipping step 3 reloads on demand at the first unpack.

    ``layer_id`` is the position of the ``with`` entry within its forward (0 to
    ``model_layers - 1``). ``forward`` picks the forward: ``None`` (default) the latest
    one started, else its number (:attr:`forward` was that number while it ran; forwards
    are numbered from 0 in the order they start). Several forwards can be in flight at
    once (pipeline schedules such as 1F1B): each has its own layers. A forward none of
    whose saved tensors is alive any more (its backward ran, its graph was freed, or
    nothing it saved qualified) is over: calls naming it do nothing.

    Raises (each method):
        TypeError: ``layer_id`` or ``forward`` is not an int.
        ValueError: ``layer_id`` is outside ``[0, model_layers)``, or ``forward`` names
            a forward that has not started.
        RuntimeError: the layer has not run yet in that forward, or is still running
            (inside its ``with`` block); or the call is out of order (a second start, a
            release before the start, a reload before the release).

    Args:
        ctx: the manual context it drives (made by :func:`get_cpu_offload_context`,
            which returns both).

    Example:
        >>> import offload
        >>> ctx, sync, sched = offload.get_cpu_offload_context(
        ...     True, model_layers=1, manual_synchronization=True)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> with ctx:
        ...     y = torch.nn.Linear(8, 8)(x)
        >>> y = sync(y)
        >>> sched.state(0)
        'saved'
    """

    def __init__(self, ctx: _ManualContext) -> None:
        self._ctx = ctx

    @property
    def offload_stream(self) -> Any:
        """The ``offload_stream`` given to :func:`get_cpu_offload_context` (``None``:
        the copies use streams of their own)."""
        return self._ctx.runtime.offload_stream

    @property
    def forward(self) -> int | None:
        """The number of the latest forward started (``None`` before the first)."""
        n = self._ctx.forwards
        return n - 1 if n else None

    def _find(self, what: str, layer_id: Any, forward: Any) -> tuple[Step, Any] | None:
        ctx = self._ctx
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(
                f"{what}: layer_id must be an int; got {type(layer_id).__name__} {layer_id!r}"
            )
        if not 0 <= layer_id < ctx.model_layers:
            raise ValueError(
                f"{what}: layer_id={layer_id} is out of range; accepted: 0 <= layer_id < "
                f"model_layers={ctx.model_layers}"
            )
        if forward is None:
            if ctx.forwards == 0:
                raise RuntimeError(
                    f"{what}({layer_id}): no forward has started yet; call it after layer "
                    f"{layer_id}'s `with` block"
                )
            forward = ctx.forwards - 1
        elif isinstance(forward, bool) or not isinstance(forward, int):
            raise TypeError(
                f"{what}: forward must be an int or None; got {type(forward).__name__} {forward!r}"
            )
        elif not 0 <= forward < ctx.forwards:
            raise ValueError(
                f"{what}: forward={forward} has not started; accepted: 0 <= forward < "
                f"{ctx.forwards} (the forwards started so far)"
            )
        step = ctx.by_number.get(forward)
        if step is None or (step is not ctx.step and _forward_over(step)):
            return None
        if layer_id >= len(step.groups):
            raise RuntimeError(
                f"{what}({layer_id}): layer {layer_id} of forward {forward} has not run yet "
                f"({len(step.groups)} of its {ctx.model_layers} layers ran)"
            )
        group = step.groups[layer_id]
        if not group.closed:
            raise RuntimeError(
                f"{what}({layer_id}): layer {layer_id} of forward {forward} is still running; "
                f"call it after the layer's `with` block"
            )
        needed, meaning = _PHASE_NEEDED[what]
        if group.phase.value != needed:
            raise RuntimeError(
                f"{what}({layer_id}) out of order: layer {layer_id} of forward {forward} is "
                f"in state {group.phase.value!r}; this call needs {needed!r} ({meaning}). Order "
                f"per layer: start_offload_layer, release_activation_forward_gpu_memory, "
                f"start_reload_layer, once each"
            )
        return step, group

    def state(self, layer_id: int, forward: int | None = None) -> str:
        """Where layer ``layer_id`` of a forward stands: ``"saved"`` (nothing started),
        ``"offload_started"``, ``"released"``, ``"reload_started"``; ``"over"`` for a
        forward that is over, ``"not_run"`` for a layer that has not run yet."""
        ctx = self._ctx
        n = ctx.forwards - 1 if forward is None else forward
        step = ctx.by_number.get(n)
        if step is None or (step is not ctx.step and _forward_over(step)):
            return "over"
        if not 0 <= layer_id < len(step.groups):
            return "not_run"
        return step.groups[layer_id].phase.value

    def stats(self, forward: int | None = None) -> OffloadStats:
        """The :class:`OffloadStats` of a forward (default: the latest one started)."""
        ctx = self._ctx
        n = ctx.forwards - 1 if forward is None else forward
        step = ctx.by_number.get(n)
        return OffloadStats() if step is None else step.read_stats()

    def start_offload_layer(self, layer_id: int, *, forward: int | None = None) -> None:
        """Issue the device-to-host copies of layer ``layer_id``'s saved tensors.

        They start after the work queued so far on the compute stream (so after every
        kernel that wrote them) on the copy stream (``offload_stream`` when given), and
        an event is recorded after them. Call it after the layer's ``with`` block."""
        found = self._find("start_offload_layer", layer_id, forward)
        if found is not None:
            step, group = found
            step.manual_start(group)

    def release_activation_forward_gpu_memory(
        self, layer_id: int, *, forward: int | None = None
    ) -> None:
        """Free layer ``layer_id``'s saved tensors on the device: the compute stream
        (where the layer ran) waits for the copies' event, then the device references are
        dropped. The host does not wait."""
        found = self._find("release_activation_forward_gpu_memory", layer_id, forward)
        if found is not None:
            step, group = found
            step.manual_release(group)

    def start_reload_layer(self, layer_id: int, *, forward: int | None = None) -> None:
        """Issue the host-to-device copies of layer ``layer_id``'s offloaded tensors into
        fresh device buffers; the backward's first use of each waits for its copy on
        the compute stream."""
        found = self._find("start_reload_layer", layer_id, forward)
        if found is not None:
            step, group = found
            step.manual_reload(group)


def _prune(steps: list[Step]) -> list[Step]:
    """Remove the hooks of the finished steps (their backward ran, or their graph is
    gone) and return the others, whose backward is still to come."""
    waiting = []
    for step in steps:
        if step.finished:
            step.remove_hooks()
        else:
            waiting.append(step)
    return waiting
