"""Measure what offloading saves on the user's own model: :func:`profile_step`, which
returns a :class:`~offload.MemoryProfile` (data: ``_data.py`` beside this module).

It reaches the offloader's private state only through
``offload/activations/_control.py``, the control the activation package gives the tools
that measure it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from offload._core import _dynamo, _measure
from offload.activations._control import Internals
from offload.profiling._data import MemoryProfile, Timeline
from offload.profiling._timeline import record_timeline
from offload.stats import OffloadStats

__all__ = ["MemoryProfile", "profile_step"]

_NOT_ENTERED = (
    "step_fn never entered `with offloader:`; profile_step needs a step function that "
    "runs its forward inside the offloader's context"
)
_NO_BACKWARD = (
    "step_fn ran no backward through the offloader's layers (no layer output's gradient "
    "was computed): profile_step measures forward + backward, so step_fn must call "
    "backward (e.g. loss.backward()) after the forward it runs inside `with offloader:`"
)


def _device_of(layers: list[torch.nn.Module]) -> torch.device:
    for layer in layers:
        for t in (*layer.parameters(), *layer.buffers()):
            if t.device.type == "cuda":
                index = (
                    t.device.index if t.device.index is not None else torch.cuda.current_device()
                )
                return torch.device("cuda", index)
            return t.device
    return torch.device("cpu")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _saved_bytes(step_fn: Callable[[], Any], params: list[torch.Tensor]) -> int:
    """Run ``step_fn`` once (offloader disabled) and count the bytes of the distinct
    storages autograd saves for backward, parameters and their views excluded (a leaf
    that requires grad, a view of one, or a storage of ``params``)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        is_param = (base.is_leaf and base.requires_grad) or (
            t.untyped_storage().data_ptr() in param_ptrs
        )
        if not is_param and t.layout == torch.strided and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(_dynamo.opaque(pack), lambda t: t):
        step_fn()
    seen.pop(0, None)
    return sum(seen.values())


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")


@dataclasses.dataclass
class _Run:
    """One :func:`profile_step` call's settings and progress."""

    step_fn: Callable[[], Any]
    params: list[torch.Tensor]
    device: torch.device
    steps: int
    warmup: int
    on_step: Callable[[str, int, int], None] | None
    done: int = 0

    @property
    def total(self) -> int:
        return 2 * (self.warmup + self.steps) + 1

    def tick(self, phase: str) -> Callable[[], None]:
        def tick() -> None:
            self.done += 1
            if self.on_step is not None:
                self.on_step(phase, self.done, self.total)

        return tick

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def phase(self, name: str) -> _measure.StepTimes:
        return _measure.timed_steps(
            self.step_fn,
            self.steps,
            self.warmup,
            device=self.device,
            before_step=self.clear_grads,
            after_step=self.tick(name),
        )


def _without(run: _Run, inner: Internals) -> tuple[_measure.StepTimes, int | None]:
    """The phase without offloading; on the CPU also what a step saves for backward."""
    with inner.disabled() as entries:
        times = run.phase("without")
        if entries() == 0:
            raise RuntimeError(_NOT_ENTERED)
        if run.device.type == "cuda":
            return times, None
        run.clear_grads()  # no allocator peak: count what a step saves for backward
        return times, _saved_bytes(run.step_fn, run.params)


def _with(run: _Run, inner: Internals) -> tuple[_measure.StepTimes, OffloadStats, Timeline]:
    """The phase with offloading (timed copies), then one step on a time axis."""
    with inner.timing_on():
        before = inner.last_step()
        times = run.phase("with")
        if inner.last_step() is before:
            raise RuntimeError(_NOT_ENTERED)
        stats = OffloadStats.from_dict(inner.off.stats.to_dict())  # the last measured
        timeline = record_timeline(
            run.step_fn, run.params, run.device, inner.layers, inner.copy_records
        )
        run.tick("timeline")()
    if timeline.layers and all(la.backward_start_ms is None for la in timeline.layers):
        raise RuntimeError(_NO_BACKWARD)
    return times, stats, timeline


def profile_step(
    step_fn: Callable[[], Any],
    offloader: Any,
    *,
    steps: int = 3,
    warmup: int = 1,
    parameters: Iterable[torch.Tensor] | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
) -> MemoryProfile:
    """Measure what offloading saves, and costs, on your own training step.

    ``step_fn()`` runs one forward and backward of your model (no optimizer step) and
    must itself enter ``with offloader:`` around the forward, as in training. It is run
    ``warmup + steps`` times with offloading disabled, then ``warmup + steps`` times
    enabled, then once more to record a timeline, all on the same model and state:

    * **Without offloading** ``with offloader:`` does nothing at all: no layer hooks and
      no saved-tensor hooks are installed, so the baseline is the model as it runs
      without this library.
    * **With offloading** the offloader runs with its own settings plus ``timing=True``
      (copies and stalls timed; restored afterwards).
    * **Gradients**: before every step, ``.grad`` of every tensor of ``parameters`` is
      set to ``None`` (as ``optimizer.zero_grad()`` does), so each step starts from the
      same memory. Gradients of parameters not listed accumulate across steps (the same
      way in both phases).
    * **Memory** (CUDA): ``torch.cuda.reset_peak_memory_stats`` before each step, then
      ``max_memory_allocated``/``max_memory_reserved`` after it; the profile keeps the
      maximum over the measured steps (``bytes_saved`` = peak without - peak with). The
      caching allocator's free blocks are released (``empty_cache``) before each phase.
      Without an accelerator torch has no device peak: ``bytes_saved`` is the
      offloader's ``stats.bytes_released`` and ``memory_source`` says so.
    * **Time**: medians over the measured steps of CUDA events recorded around
      ``step_fn()`` on the current stream (``time.perf_counter`` on the CPU).

    Also measured: the pinned link bandwidth (CUDA), the host pool and the process RSS.

    Args:
        step_fn: ``callable()`` running forward (inside ``with offloader:``) and
            backward; its return value is ignored.
        offloader: the :class:`~offload.ActivationOffloader` that ``step_fn`` enters.
        steps: measured steps per phase (>= 1). Default ``3``.
        warmup: unmeasured steps before them (>= 0). Default ``1``.
        parameters: tensors whose ``.grad`` is set to ``None`` before every step.
            Default ``None``: the parameters of the offloader's layers. Pass
            ``model.parameters()`` to cover the whole model.
        on_step: ``callable(phase, done, total)`` called after every step, ``phase`` in
            ``"without"``, ``"with"``, ``"timeline"`` (progress display). Default ``None``.

    Returns:
        A :class:`MemoryProfile` (``report()``, ``to_dict()``, ``plot(path)``).

    Raises:
        TypeError: ``offloader`` is not an ActivationOffloader, ``step_fn`` is not
            callable, or ``steps``/``warmup`` is not an int.
        ValueError: ``steps`` < 1 or ``warmup`` < 0.
        RuntimeError: ``step_fn`` did not enter ``with offloader:``, or ran no backward.

    Example:
        >>> import offload, torch
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
        >>> off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
        >>> x = torch.randn(64, 256)
        >>> def step():
        ...     with off:
        ...         y = x
        ...         for layer in layers:
        ...             y = torch.relu(layer(y))
        ...     y.square().mean().backward()
        >>> profile = offload.profile_step(step, off, steps=2)
        >>> profile.memory_source, profile.bytes_saved > 0
        ('offloader_stats', True)
        >>> off.close()
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable; got {type(step_fn).__name__}")
    inner = Internals(offloader)
    _check_count("steps", steps, 1)
    _check_count("warmup", warmup, 0)
    device = _device_of(inner.layers)
    cuda = device.type == "cuda"
    if parameters is None:
        params = list(dict.fromkeys(p for layer in inner.layers for p in layer.parameters()))
    else:
        params = list(parameters)
    run = _Run(step_fn, params, device, steps, warmup, on_step)
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        link = _measure.link_bandwidth(device) if cuda else None
        without, saved_for_backward = _without(run, inner)
        rss_without = _rss()
        with_, stats, timeline = _with(run, inner)
        rss_with = _rss()
    if cuda:
        assert without.peak_allocated is not None and with_.peak_allocated is not None
        saved = without.peak_allocated - with_.peak_allocated
        act_without, act_with = without.activation, with_.activation
        source = "cuda_allocator"
    else:
        assert saved_for_backward is not None
        saved = stats.bytes_released
        act_without = saved_for_backward
        act_with = act_without - saved
        source = "offloader_stats"
    return MemoryProfile(
        device=str(device),
        memory_source=source,
        steps=steps,
        warmup=warmup,
        step_ms_without=without.median * 1e3,
        step_ms_with=with_.median * 1e3,
        step_ms_without_all=[x * 1e3 for x in without.seconds],
        step_ms_with_all=[x * 1e3 for x in with_.seconds],
        bytes_saved=int(saved),
        activation_bytes_without=int(act_without or 0),
        activation_bytes_with=int(act_with or 0),
        peak_allocated_without=without.peak_allocated,
        peak_allocated_with=with_.peak_allocated,
        peak_reserved_without=without.peak_reserved,
        peak_reserved_with=with_.peak_reserved,
        host_pool_reserved_bytes=int(stats.host_pool_reserved_bytes),
        host_pinned=bool(cuda and offloader.config.pin_memory),
        rss_bytes_without=rss_without,
        rss_bytes_with=rss_with,
        link_d2h_gbps=None if link is None else link[0] / 1e9,
        link_h2d_gbps=None if link is None else link[1] / 1e9,
        stats=stats,
        timeline=timeline,
    )
