"""Offloading inside per-layer CUDA graphs: :func:`make_graphed_callables` captures each
offloaded layer call as a one-group forward that joins its copies at its own end and
reloads them at the start of its own backward graph, so no copy crosses from one layer's
graph into the next. A whole step captured in one graph needs nothing from here: enter
the offloader inside the capture (``# Note [release order]`` in ``offload/activations/_step.py``)."""

from __future__ import annotations

from typing import Any

import torch

from offload._core import _context, _device, _dynamo
from offload.activations._handles import Kept, unpack_hook
from offload.activations._offloader import ActivationOffloader
from offload.activations._schedule import Schedule, plan_forward
from offload.activations._step import Step
from offload.stats import OffloadStats

__all__ = ["make_graphed_callables"]


class _Captured:
    """What ``offloader.stats`` reads after :func:`make_graphed_callables`: the stats of
    every captured layer call, merged (one :class:`LayerStats` per call)."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.groups = [g for s in steps for g in s.groups]

    def read_stats(self) -> OffloadStats:
        out = OffloadStats()
        for step in self.steps:
            s = step.read_stats()
            out.bytes_offloaded += s.bytes_offloaded
            out.bytes_reloaded += s.bytes_reloaded
            out.bytes_released += s.bytes_released
            for reason, n in s.bytes_kept.items():
                out.bytes_kept[reason] = out.bytes_kept.get(reason, 0) + n
            for name, n in s.bytes_by_dtype.items():
                out.bytes_by_dtype[name] = out.bytes_by_dtype.get(name, 0) + n
            out.layers.extend(s.layers)
            out.host_pool_bytes = s.host_pool_bytes
            out.host_pool_reserved_bytes = s.host_pool_reserved_bytes
            out.host_pool_peak_bytes = s.host_pool_peak_bytes
        return out


class _LayerCapture:
    """Saved-tensor and module hooks of :func:`make_graphed_callables`: a layer call made
    while a graph is being captured is a one-group forward (``Step.capture ==
    "layer"``); calls made outside a capture (the warm-up iterations) keep everything."""

    def __init__(self, offloader: Any) -> None:
        if not isinstance(offloader, ActivationOffloader):
            raise TypeError(
                f"offloader must be an offload.ActivationOffloader; got {type(offloader).__name__}"
            )
        view = offloader._capture_view()
        selection = view.selection
        if selection == "auto":
            raise ValueError(
                "offload_layers='auto' measures eager forwards, which per-layer graph "
                "capture does not run; give the offloader an explicit offload_layers "
                "(an int, 'all', indices or a callable)"
            )
        self.off = offloader
        self.runtime = view.runtime
        layers = view.layers
        #: each module's position in the offloader's layers (its first one)
        self.position: dict[int, int] = {}
        for i, m in enumerate(layers):
            self.position.setdefault(id(m), i)
        self.offloaded = plan_forward(selection, layers, None).offloaded
        self.step: Step | None = None
        self.steps: list[Step] = []
        self._hooks: list[Any] = []
        self._saved: Any = None

    def __enter__(self) -> _LayerCapture:
        _context.claim(self.off, "ActivationOffloader")
        # Global module hooks, not hooks on the layers: torch.cuda.make_graphed_callables
        # refuses modules that have hooks of their own.
        self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._start))
        self._hooks.append(torch.nn.modules.module.register_module_forward_hook(self._end))
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_hook)
        self._saved.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            step, self.step = self.step, None
            if step is not None:  # the capture of a layer raised
                step.abort()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            saved, self._saved = self._saved, None
            _context.release(self.off)
            if saved is not None:
                saved.__exit__(exc_type, exc, tb)

    def _pack(self, t: torch.Tensor) -> Any:
        step = self.step
        return Kept(t) if step is None else step.pack(t)

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        position = self.position.get(id(module))
        if position is None:  # not one of the offloader's layers
            return
        step = self.step
        if step is not None:  # a registered layer inside the captured one
            step.open_group(module, (args, {}))
            return
        if not _device.capturing():
            return  # a warm-up call: nothing is offloaded
        chosen = position in self.offloaded
        offloaded = frozenset({0}) if chosen else frozenset()
        plan = Schedule(
            1, offloaded, {}, {0: (0,)} if chosen else {}, lambda i, m: i == 0 and chosen
        )
        step = self.step = Step(self.runtime, plan)
        step.capture = "layer"
        step.open_group(module, (args, {}))
        step.groups[0].stats.index = position

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        step = self.step
        if step is None or id(module) not in self.position:
            return
        nested = step.depth > 0
        step.close_group(output)
        if not nested:
            step.finish_forward()
            self.steps.append(step)
            self.step = None


_dynamo.opaque(_LayerCapture._pack)  # the pack hook: never a frame for dynamo


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    *,
    offloader: Any,
    **kwargs: Any,
) -> Any:
    """``torch.cuda.make_graphed_callables`` with ``offloader`` offloading inside each
    captured layer.

    Each call of one of ``offloader``'s layers captured here (the layers themselves, or
    callables that call them) becomes a forward of one group: the activations it saves
    are copied to pinned host memory inside its forward graph and reloaded at the start
    of its backward graph. A layer's graph is self-contained: its copies overlap the
    rest of that layer's forward, and its forward graph ends when they have landed, so
    only the layer's output stays on the device between graphs. (In a whole step
    captured in one graph, copies also overlap later layers: prefer that when the step
    can be captured whole; see :class:`ActivationOffloader`.)

    Invariants: replays are bitwise equal to the same graphs captured without
    offloading; the host blocks the graphs write are bound to them until
    ``offloader.free_graph_memory()`` or the offloader's deletion (keep it referenced
    while the graphs are replayed; the pool's bytes do not change across replays); nothing of
    the offloader runs in Python on replay. ``offloader.stats`` afterwards merges the
    captured layer calls.

    Args:
        callables: as for ``torch.cuda.make_graphed_callables``: a callable or a tuple
            of them, in the order they run.
        sample_args: as for ``torch.cuda.make_graphed_callables``.
        offloader: the :class:`ActivationOffloader` whose ``layers`` and
            ``offload_layers`` decide what is offloaded (``offload_layers`` by the
            layer's position in ``layers``; ``"auto"`` is refused: it measures eager
            forwards). It must not be entered; the graphed callables are replayed
            outside it.
        **kwargs: passed to ``torch.cuda.make_graphed_callables`` (``num_warmup_iters``,
            ``allow_unused_input``, ``pool``).

    Returns:
        What ``torch.cuda.make_graphed_callables`` returns.

    Raises:
        TypeError: ``offloader`` is not an :class:`ActivationOffloader`.
        ValueError: ``offloader.config.offload_layers`` is ``"auto"``.
        RuntimeError: CUDA is not available; an offload context is already active on
            this thread; or ``timing=True`` (event times cannot be read in a capture).
        NotImplementedError: ``compress="fp8"`` (not supported in captures yet).

    Example (needs a CUDA device)::

        layers = [torch.nn.Linear(1024, 1024, device="cuda") for _ in range(4)]
        off = offload.ActivationOffloader(layers, offload_layers=3, min_tensor_bytes=0)
        samples = tuple(
            (torch.randn(64, 1024, device="cuda", requires_grad=True),) for _ in layers
        )
        graphed = offload.make_graphed_callables(tuple(layers), samples, offloader=off)
        h = x
        for layer in graphed:  # replays: outside the offloader's context
            h = layer(h)
        h.square().mean().backward()
    """
    capture = _LayerCapture(offloader)
    if not torch.cuda.is_available():
        raise RuntimeError(
            "offload.make_graphed_callables captures CUDA graphs and needs a CUDA device; "
            "without one, use the offloader eagerly (with offloader: ...)"
        )
    with capture:
        graphed = torch.cuda.make_graphed_callables(callables, sample_args, **kwargs)
    offloader._show_stats_of(_Captured(capture.steps))
    return graphed
