"""The TransformerEngine-compatible API: :func:`get_cpu_offload_context` (manual
offloading, one ``with`` entry per layer), :func:`mark_not_offload` and
:func:`start_offload` (TransformerEngine's tensor marks)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from offload._core import _context, _packing
from offload._core._warn import warn_at_caller
from offload.activations import ActivationOffloader
from offload.activations._control import running_step
from offload.activations._manual import ManualOffloadSynchronizer, _ManualContext
from offload.config import OffloadConfig

__all__ = ["get_cpu_offload_context", "mark_not_offload", "start_offload"]


def _identity(x: Any) -> Any:
    return x


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    *,
    retain_pinned_cpu_buffers: bool = False,
    manual_synchronization: bool = False,
    offload_stream: Any = None,
) -> tuple[Any, ...]:
    """TransformerEngine-style manual offloading: ``(context, sync)``, or ``(context,
    sync, synchronizer)`` with ``manual_synchronization=True``.

    Each ``with context:`` entry is one group (one layer); after ``model_layers``
    entries the next entry starts a new forward. The first ``num_layers`` groups of each
    forward are offloaded, with the same schedule as :class:`ActivationOffloader`. Call
    ``x = sync(x)`` on each layer's output after its ``with`` block: it marks the group
    boundary for the backward (reload triggers) and returns ``x`` itself.

    With ``manual_synchronization=True`` there is no schedule: the third value, a
    :class:`ManualOffloadSynchronizer`, starts each layer's copies, releases its device
    memory and starts its reload when the caller says (``start_offload_layer``,
    ``release_activation_forward_gpu_memory``, ``start_reload_layer``), for the latest
    forward or a given one, so several forwards can be in flight (pipeline schedules).

    Args:
        enabled: ``False`` (default) returns ``(contextlib.nullcontext(), identity)``
            (and ``None`` as the third value with ``manual_synchronization=True``).
        num_layers: groups offloaded per forward; ``0 <= num_layers <= model_layers - 1``.
            Default 1. Ignored with ``manual_synchronization=True`` (may be ``None``).
        model_layers: groups per forward. Default 1.
        offload_activations: offload saved activations. Default ``True``.
        offload_weights: also offload the weights of the modules called inside the
            first ``num_layers`` groups, with an :class:`offload.WeightOffloader`
            (``context.weights``) that adopts each module at its first call. Default
            ``False``. With ``manual_synchronization=True`` it has no effect (a warning
            says so; TransformerEngine 2.10 ignores it always).
        double_buffering: as in :class:`ActivationOffloader`. Default ``False``.
        retain_pinned_cpu_buffers: keyword-only. ``True``: the host pool never gives a
            slab back before the context is dropped, so host addresses stay valid from
            one step to the next (what CUDA graphs need); a tensor that would only fit
            by returning empty slabs stays on the device instead (reason
            ``host_limit``). ``False`` (default): the pool still keeps its slabs across
            steps, but when over ``host_memory_limit`` it returns empty slabs too small
            for a request and takes one that fits. (TransformerEngine allocates pinned
            buffers per tensor and frees them after each reload unless this is set;
            our pool reuses its slabs in both cases.)
        manual_synchronization: keyword-only. ``True``: return ``(context, sync,
            synchronizer)``; nothing is offloaded, released or reloaded unless the
            synchronizer says so (``num_layers`` is ignored). Default ``False``.
        offload_stream: keyword-only. A ``torch.cuda.Stream`` on the layers' device that
            carries every device-to-host and host-to-device copy (both directions, as in
            TransformerEngine), so the caller can synchronize with it (``wait_stream``,
            events, ``offload_stream.synchronize()``). Only with
            ``manual_synchronization=True``. Default ``None``: the copies use streams of
            their own.

    Returns:
        ``(context, sync)``; with ``manual_synchronization=True``, ``(context, sync,
        synchronizer)``.

    Raises:
        TypeError: an argument has the wrong type (``offload_stream`` not a
            ``torch.cuda.Stream`` or ``None``).
        ValueError: ``num_layers`` or ``model_layers`` is out of range (without
            ``manual_synchronization``); ``offload_stream`` is given without
            ``manual_synchronization=True`` (TransformerEngine asserts both).
        RuntimeError: ``offload_stream`` is given but CUDA is not available.

    Example:
        >>> ctx, sync = get_cpu_offload_context(True, num_layers=1, model_layers=2)
        >>> layers = [torch.nn.Linear(8, 8) for _ in range(2)]
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         x = layer(x)
        ...     x = sync(x)
        >>> x.sum().backward()

        Manual synchronization (one forward; a pipeline schedule names the forward):

        >>> ctx, sync, sched = get_cpu_offload_context(
        ...     True, model_layers=2, manual_synchronization=True)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> for i, layer in enumerate(layers):
        ...     with ctx:
        ...         x = layer(x)
        ...     x = sync(x)
        ...     sched.start_offload_layer(i)
        >>> for i in range(2):
        ...     sched.release_activation_forward_gpu_memory(i)
        >>> for i in reversed(range(2)):
        ...     sched.start_reload_layer(i)
        >>> x.sum().backward()
    """
    _check_types(
        {
            "enabled": enabled,
            "offload_activations": offload_activations,
            "offload_weights": offload_weights,
            "double_buffering": double_buffering,
            "retain_pinned_cpu_buffers": retain_pinned_cpu_buffers,
            "manual_synchronization": manual_synchronization,
        },
        num_layers,
        model_layers,
        offload_stream,
    )
    if not enabled:
        if manual_synchronization:
            return contextlib.nullcontext(), _identity, None
        return contextlib.nullcontext(), _identity
    _check_values(num_layers, model_layers, manual_synchronization, offload_stream)
    if manual_synchronization:
        return _manual_contexts(
            model_layers,
            offload_activations=offload_activations,
            offload_weights=offload_weights,
            double_buffering=double_buffering,
            offload_stream=offload_stream,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        )
    if not offload_activations:
        pair: tuple[Any, Callable[[Any], Any]] = (contextlib.nullcontext(), _identity)
    else:
        config = OffloadConfig(offload_layers=num_layers, double_buffering=double_buffering)
        ctx = _ManualContext(
            num_layers,  # type: ignore[arg-type]
            model_layers,
            config,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        )
        pair = (ctx, ctx.sync)
    if offload_weights:  # weights too: the weight offloader wraps the pair
        # loaded here: it imports dynamo (as costly as torch) when it loads
        from offload.weights._manual import manual_weight_context

        return manual_weight_context(pair, num_layers, model_layers)  # type: ignore[arg-type]
    return pair


def _check_types(
    flags: dict[str, Any], num_layers: Any, model_layers: Any, offload_stream: Any
) -> None:
    """The type checks of :func:`get_cpu_offload_context`, made even when disabled."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}")
    for name, value in (("num_layers", num_layers), ("model_layers", model_layers)):
        if name == "num_layers" and value is None and flags["manual_synchronization"]:
            continue  # ignored in manual mode (TransformerEngine's docs pass none)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if offload_stream is not None and not isinstance(offload_stream, torch.cuda.Stream):
        raise TypeError(
            f"offload_stream must be a torch.cuda.Stream or None; got "
            f"{type(offload_stream).__name__} {offload_stream!r}"
        )


def _check_values(
    num_layers: int | None, model_layers: int, manual: bool, offload_stream: Any
) -> None:
    """The value checks of an enabled :func:`get_cpu_offload_context`."""
    if model_layers < 1:
        raise ValueError(f"model_layers={model_layers}: must be >= 1")
    if not manual and not 0 <= num_layers <= model_layers - 1:  # type: ignore[operator]
        raise ValueError(
            f"num_layers={num_layers}: must satisfy 0 <= num_layers <= model_layers - 1 "
            f"= {model_layers - 1} (as in TransformerEngine; with "
            f"manual_synchronization=True any layer may be offloaded)"
        )
    if offload_stream is not None:
        if not manual:
            raise ValueError(
                "offload_stream may be given only with manual_synchronization=True (as in "
                "TransformerEngine); pass offload_stream=None or manual_synchronization=True"
            )
        if not torch.cuda.is_available():
            raise RuntimeError(
                "offload_stream was given but CUDA is not available; pass offload_stream=None"
            )


def _manual_contexts(
    model_layers: int,
    *,
    offload_activations: bool,
    offload_weights: bool,
    double_buffering: bool,
    offload_stream: Any,
    retain_pinned_cpu_buffers: bool,
) -> tuple[Any, ...]:
    """``get_cpu_offload_context(..., manual_synchronization=True)``'s three values."""
    if offload_weights:
        warn_at_caller(
            "offload: offload_weights=True has no effect with "
            "manual_synchronization=True (TransformerEngine 2.10 ignores it too); only "
            "activations are offloaded"
        )
    if not offload_activations:
        return contextlib.nullcontext(), _identity, None
    config = OffloadConfig(offload_layers=None, double_buffering=double_buffering)
    ctx = _ManualContext(
        0,
        model_layers,
        config,
        manual=True,
        offload_stream=offload_stream,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
    )
    return ctx, ctx.sync, ManualOffloadSynchronizer(ctx)


def _parts(t: Any) -> list[torch.Tensor]:
    """The tensors whose attributes TransformerEngine's marks set: a TE quantized
    tensor's data and scale tensors (``prepare_for_saving()``; the object is refilled
    at once), else the tensor itself."""
    if _packing.is_te_quantized(t):
        parts, obj = t.prepare_for_saving()
        obj.restore_from_saved(parts)  # the same tensor objects go back in
        return [p for p in parts if p is not None]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected tensors (or None); got {type(t).__name__} {t!r}")
    return [t]


def mark_not_offload(*tensors: Any) -> None:
    """Keep these tensors on the device whenever they are saved for backward inside an
    offload context (TransformerEngine's ``mark_not_offload``).

    Sets the attribute ``_TE_do_not_offload`` on each tensor (on the data and scale
    tensors of a TransformerEngine quantized tensor, as TransformerEngine does), which
    every offloader of this package honours: the tensor is counted under the keep
    reason ``opted_out``. ``None`` entries are skipped. Works inside and outside any
    offload context; the mark stays with the tensor object.

    Args:
        *tensors: tensors, TransformerEngine quantized tensors or ``None``, in any
            number.

    Raises:
        TypeError: an entry is neither a tensor, a TE quantized tensor nor ``None``.

    Example:
        >>> t = torch.randn(1024, 1024)
        >>> mark_not_offload(t)
        >>> t._TE_do_not_offload
        True
    """
    for t in tensors:
        if t is None:
            continue
        for part in _parts(t):
            part._TE_do_not_offload = True


def start_offload(*tensors: Any, offload_base_tensor: bool = False) -> None:
    """Say that these tensors are fully computed and may be copied to the host
    (TransformerEngine's ``start_offload``). Safe to call anywhere: outside an offload
    context it only sets the mark below.

    TransformerEngine records an event here that a later copy of the tensor waits for.
    Here the copy of a saved tensor is queued when it is saved and waits for everything
    queued on the compute stream until it is issued, which includes the kernels that
    produced the tensor, so no event is needed; what this call does:

    * Inside an offload context on this thread (an :class:`ActivationOffloader` or
      :func:`get_cpu_offload_context` entry): if a queued copy (not yet issued: copies
      are issued in small batches) reads one of these tensors' storage, the queue is
      issued now, so the copy starts as early as TransformerEngine's would. In manual
      mode (``manual_synchronization=True``) a layer's copies are issued by its
      ``start_offload_layer`` and nothing more happens here.
    * ``offload_base_tensor=True``: each tensor that is a view (``t._base is not
      None``) is marked (attribute ``offload_base_tensor``, TransformerEngine's name),
      and when it is saved its copy covers its base's whole span, so the other views of
      the same base saved later (e.g. interleaved q, k, v) find their bytes already
      copied and cost no second copy. A view that spans at least half its storage is
      copied that way anyway.

    ``None`` entries are skipped; TE quantized tensors act through their data tensors.

    Args:
        tensors: the tensors (or ``None``).
        offload_base_tensor: copy the base of a view instead of the view. Default
            ``False``.

    Raises:
        TypeError: ``offload_base_tensor`` is not a bool, or an entry is not a tensor.

    Example:
        >>> qkv = torch.randn(8, 3 * 64)
        >>> q, k, v = qkv.chunk(3, dim=-1)
        >>> start_offload(q, k, v, offload_base_tensor=True)
    """
    if not isinstance(offload_base_tensor, bool):
        raise TypeError(
            f"offload_base_tensor must be a bool; got {type(offload_base_tensor).__name__} "
            f"{offload_base_tensor!r}"
        )
    flat: list[torch.Tensor] = []
    for t in tensors:
        if t is not None:
            flat.extend(_parts(t))
    if offload_base_tensor:
        for t in flat:
            if t._base is not None:
                t.offload_base_tensor = True
    owner = _context.owner()
    step = None
    if isinstance(owner, ActivationOffloader):
        step = running_step(owner)
    elif isinstance(owner, _ManualContext):
        step = owner.step
    if step is None or not flat:
        return
    plain = [t for t in flat if _packing.is_plain(t) and t.layout == torch.strided]
    if plain:
        step.flush_for(plain)
