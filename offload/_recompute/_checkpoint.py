"""Offloaded activation checkpointing: :func:`checkpoint`, :class:`CheckpointOffloader`.

Checkpointing keeps, per checkpointed call, only what the recomputation needs: the
call's inputs. With L checkpointed layers that is L x batch x seq x hidden x itemsize
bytes, which dominates at long sequences. :func:`checkpoint` is a drop-in for
``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``
that keeps those inputs in (pinned) host memory instead and brings them back ahead of the
recomputation.

Note [checkpoint inputs]
~~~~~~~~~~~~~~~~~~~~~~~~
What keeps a checkpoint's device inputs alive in torch's non-reentrant implementation
(``_checkpoint_without_reentrant_generator``, torch 2.6 to 2.13):

* the positional tensor arguments are saved for the recomputation, as saved variables
  of the checkpoint's frame (``_NoopSaveInputs.save_for_backward`` up to torch 2.11,
  ``_CheckpointFrame.save_inputs`` / ``_make_saved_tensor`` in 2.13). They live as
  long as the frame, i.e. as long as any tensor saved inside the region;
* ``recompute_fn`` is a closure over ``fn`` and ``kwargs``: tensors passed by keyword,
  tensors nested in containers, and anything ``fn`` itself captures stay referenced;
* nothing else holds data: RNG states are host-side, the device type is a string, the
  determinism check records shape/dtype/device only.

So this module never hands torch a device input it offloads. For each call,

1. *Stash.* The arguments (positional, keyword, and tensors nested in containers that
   ``torch.utils._pytree`` knows) are flattened. Each tensor is kept (passed to torch as
   is, with a reason:
   ``parameter``, ``small``, ``device``, ``unsupported``, ``opted_out``, ``host_limit``)
   or copied to a host block of the pool at once: the D2H stream waits for the current
   (compute) stream first, so the copy starts after the kernel that wrote the bytes
   (design 4.1(a)), and for the pool's H2D fence (4.1(d)). Views of one storage share
   one copy when their spans touch; a span copied by an earlier call that is still alive
   (same storage, span and version) is reused (``bytes_shared``).
2. *Forward.* ``torch.utils.checkpoint.checkpoint(record, *slots, use_reentrant=False)``
   runs with a 0-element placeholder on the same device in place of every offloaded
   tensor (so torch still stashes that device's RNG state and picks its autocast
   settings), and the kept tensors themselves. ``record`` is called by torch once in
   the forward: it then calls ``function`` with the caller's original objects, so the
   autograd graph connects to the real inputs exactly as with torch.
3. *Release.* When the forward returns, the compute stream waits (on the device, not
   the host) for the record's D2H event, and the record drops every reference to the
   device inputs. From then on only the caller's own references keep them; when those
   go, the caching allocator can hand the blocks to later kernels of the compute
   stream, which are queued behind that wait, so none overwrites a block before its copy
   read it (4.1(b)). The versions recorded at stash time are compared first: a tensor
   modified in place during the call poisons the record, and its recomputation raises
   autograd's "modified by an inplace operation" error. A change made after the call
   cannot be seen (the record no longer watches the tensor).
4. *Prefetch.* Each call registers ``register_multi_grad_hook(outputs, mode="any")``:
   when the first gradient of call i's outputs arrives (its backward starts), call i's
   own inputs are reloaded if no later call prefetched them (they are needed first, so
   they are copied first), then those of the ``prefetch_layers`` calls made before it on
   this thread (i-1, ...): buffers are allocated in the pool of the compute stream recorded at the
   forward; the H2D stream waits for that stream (4.1(e)) and for the copies' D2H
   events, copies, and records a reload event, which becomes the pool's H2D fence.
5. *Recompute.* Torch calls ``record`` again from its unpack hook. A record not
   reloaded yet (its outputs had no gradient hook) is reloaded here. The current stream waits for the reload
   event (4.1(c)), each tensor is rebuilt with its dtype, shape, strides and
   ``requires_grad`` as a view of the reloaded bytes, and ``function`` runs on them.
   The record then drops the buffers: what the recomputation saved keeps them alive
   exactly as long as the backward needs them. Another backward of a retained graph
   reloads again.
6. *Death.* The record lives as long as torch's frame (the graph's saved tensors). A
   prefetched buffer never used is waited for on its stream before it is dropped
   (4.1(e)). A host block returns to the pool when the last record using it dies; a
   block freed while a lock is held elsewhere is queued and freed by the next caller.

An exception in the forward waits for the record's D2H copies on the compute stream,
drops its device references and returns its host blocks at once (the pool's in-use
bytes go back to where they were); a later recomputation from that graph raises.

Without an accelerator the same steps run synchronously (``SyncBackend``): copies into
pool buffers (not pinned), no events, nothing waits.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _torch_ckpt

from offload._core._runtime import Runtime, in_backward, opted_out  # no_offload() keeps inputs
from offload._core._warn import warn_at_caller
from offload._recompute._call import (
    Record,
    backward_started,
    flatten,
    grad_tensors,
    release,
    stash,
)

__all__ = [
    "CHECKPOINT_KEEP_REASONS",
    "CheckpointOffloader",
    "CheckpointStats",
    "checkpoint",
    "checkpoint_stats",
]

#: Keyword arguments of ``torch.utils.checkpoint.checkpoint`` itself (passed through);
#: every other keyword goes to ``function``.
_TORCH_KWARGS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")

#: Every reason a checkpoint input stays on the device.
CHECKPOINT_KEEP_REASONS: tuple[str, ...] = (
    "small",
    "parameter",
    "opted_out",
    "device",
    "unsupported",
    "host_limit",
)


def _reasons() -> dict[str, int]:
    return dict.fromkeys(CHECKPOINT_KEEP_REASONS, 0)


@dataclasses.dataclass
class CheckpointStats:
    """What offloaded checkpointing did since the offloader was made (or last reset).

    Counters accumulate over every call; ``reset_stats()`` (or
    ``checkpoint_stats(reset=True)``) zeroes them. The pool figures are read when the
    stats are.

    Attributes:
        calls: checkpointed calls that ran with offloading (calls without gradients,
            inside a backward or under ``torch.compile`` are plain checkpoints and not
            counted).
        tensors_offloaded: input tensors whose bytes went to the host (or reused a host
            copy made by an earlier call).
        bytes_offloaded: bytes copied device -> host.
        bytes_shared: bytes of inputs that reused a host copy of an earlier live call
            (the same storage span and version, e.g. a mask passed to every layer).
        bytes_reloaded: bytes copied host -> device (prefetches and on-demand reloads).
        bytes_kept: bytes of tensor inputs left on the device, by reason (see
            ``CHECKPOINT_KEEP_REASONS``): ``small`` (fewer than ``min_tensor_bytes``),
            ``parameter`` (an ``nn.Parameter``), ``opted_out`` (inside
            :func:`offload.no_offload` or marked ``_do_not_offload``), ``device`` (not on
            the call's device, or not a CPU/CUDA tensor), ``unsupported`` (a tensor
            subclass or a non-strided layout), ``host_limit`` (host budget reached).
        reloads_prefetched: calls whose inputs were reloaded by the backward of a later
            call, ahead of their own backward.
        reloads_on_demand: calls whose inputs were reloaded when their own backward
            started (the last call of a forward, or with ``prefetch_layers=0``), or by
            their recomputation.
        host_pool_bytes: host bytes handed out now.
        host_pool_reserved_bytes: host bytes the pool holds.
        host_pool_peak_bytes: most host bytes handed out at once since the pool was made.

    Example:
        >>> import offload, torch
        >>> ckpt = offload.CheckpointOffloader(min_tensor_bytes=0)
        >>> layers = [torch.nn.Linear(64, 64) for _ in range(3)]
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> h = x
        >>> for layer in layers:
        ...     h = ckpt.checkpoint(layer, h)
        >>> h.sum().backward()
        >>> s = ckpt.stats
        >>> s.calls, s.bytes_offloaded == s.bytes_reloaded == 3 * x.nbytes
        (3, True)
        >>> s.reloads_prefetched + s.reloads_on_demand
        3
        >>> ckpt.close()
    """

    calls: int = 0
    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    bytes_shared: int = 0
    bytes_reloaded: int = 0
    bytes_kept: dict[str, int] = dataclasses.field(default_factory=_reasons)
    reloads_prefetched: int = 0
    reloads_on_demand: int = 0
    host_pool_bytes: int = 0
    host_pool_reserved_bytes: int = 0
    host_pool_peak_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dataclasses.asdict(self)


class CheckpointRuntime(Runtime):
    """The runtime of one :class:`CheckpointOffloader`, with its counters and the index
    of live host copies that later calls may share (Note [checkpoint inputs], 1)."""

    def __init__(self, settings: Any) -> None:
        super().__init__(
            settings,
            name="offload.checkpoint",
            hint="host_memory_limit of the CheckpointOffloader",
        )
        self._placeholders: dict[torch.device, torch.Tensor] = {}
        self.stats = CheckpointStats()
        #: (storage cdata, start, end) -> a live host copy of that span
        self.shared: weakref.WeakValueDictionary[tuple[int, int, int], Any] = (
            weakref.WeakValueDictionary()
        )

    def placeholder(self, device: torch.device) -> torch.Tensor:
        """A 0-element tensor on ``device``, handed to torch for an offloaded input."""
        p = self._placeholders.get(device)
        if p is None:
            p = self._placeholders[device] = torch.empty(0, dtype=torch.uint8, device=device)
        return p


def _check_use_reentrant(use_reentrant: Any) -> None:
    if use_reentrant is None or use_reentrant is False:
        return
    if use_reentrant is True:
        raise ValueError(
            "offload.checkpoint supports only use_reentrant=False (the reentrant variant "
            "saves its inputs inside an autograd Function and cannot offload them); use "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) for that variant"
        )
    raise TypeError(
        f"use_reentrant must be False (or None); got {type(use_reentrant).__name__} "
        f"{use_reentrant!r}"
    )


# --------------------------------------------------------------------------------------
# the public objects


class CheckpointOffloader:
    """Offloaded activation checkpointing with its own settings, host pool and stats.

    :func:`offload.checkpoint` uses one process-wide instance with the default settings;
    make your own to change them, to keep separate stats, or to free the host memory with
    :meth:`close`. ``offloader.checkpoint`` has the signature and the semantics of
    :func:`offload.checkpoint`.

    Args:
        min_tensor_bytes: inputs whose byte span is smaller stay on the device (reason
            ``small``). Default ``256 * 1024``.
        prefetch_layers: when the backward of a checkpointed call starts, the inputs of
            this many calls made before it (on the same thread) are reloaded, ahead of
            their recomputation. ``0``: every reload happens on demand, when the
            recomputation starts. Default ``1``.
        pin_memory: page-lock the host pool. Default ``True``; ignored without an
            accelerator.
        host_memory_limit: bytes of host memory for offloaded inputs; ``None`` (default):
            half of the available memory divided by ``LOCAL_WORLD_SIZE`` (a separate
            budget from any :class:`offload.ActivationOffloader`'s). Past it, inputs stay
            on the device (reason ``host_limit``, one ``RuntimeWarning``).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range.

    Example:
        >>> ckpt = CheckpointOffloader(min_tensor_bytes=0)
        >>> layer = torch.nn.Linear(64, 64)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> ckpt.checkpoint(layer, x).sum().backward()
        >>> ckpt.stats.bytes_offloaded == ckpt.stats.bytes_reloaded == x.nbytes
        True
        >>> ckpt.close()
    """

    def __init__(
        self,
        *,
        min_tensor_bytes: int = 256 * 1024,
        prefetch_layers: int = 1,
        pin_memory: bool = True,
        host_memory_limit: int | None = None,
    ) -> None:
        for name, value in (
            ("min_tensor_bytes", min_tensor_bytes),
            ("prefetch_layers", prefetch_layers),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"{name}={value}: must be >= 0")
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool; got {type(pin_memory).__name__}")
        if host_memory_limit is not None:
            if isinstance(host_memory_limit, bool) or not isinstance(host_memory_limit, int):
                raise TypeError(
                    f"host_memory_limit must be an int (bytes) or None; got "
                    f"{type(host_memory_limit).__name__} {host_memory_limit!r}"
                )
            if host_memory_limit < 0:
                raise ValueError(f"host_memory_limit={host_memory_limit}: must be >= 0")
        self.min_tensor_bytes = min_tensor_bytes
        self.prefetch_layers = prefetch_layers
        self.pin_memory = pin_memory
        self.host_memory_limit = host_memory_limit
        self._rt = CheckpointRuntime(
            types.SimpleNamespace(host_memory_limit=host_memory_limit, pin_memory=pin_memory)
        )
        self._local = threading.local()  # .last: weak reference to this thread's last call

    def __repr__(self) -> str:
        return (
            f"CheckpointOffloader(min_tensor_bytes={self.min_tensor_bytes}, "
            f"prefetch_layers={self.prefetch_layers}, pin_memory={self.pin_memory}, "
            f"host_memory_limit={self.host_memory_limit})"
        )

    # ---- stats --------------------------------------------------------------------

    @property
    def stats(self) -> CheckpointStats:
        """A copy of the counters (see :class:`CheckpointStats`), pool figures refreshed."""
        rt = self._rt
        with rt.lock:
            if rt._pool is not None:
                rt.drain()
                pool = rt._pool
                rt.stats.host_pool_bytes = pool.in_use_bytes
                rt.stats.host_pool_reserved_bytes = pool.reserved_bytes
                rt.stats.host_pool_peak_bytes = pool.peak_bytes
            s = rt.stats
            return dataclasses.replace(s, bytes_kept=dict(s.bytes_kept))

    def reset_stats(self) -> None:
        """Zero the counters (the pool's peak too)."""
        rt = self._rt
        with rt.lock:
            rt.stats = CheckpointStats()
            if rt._pool is not None:
                rt._pool.peak_bytes = rt._pool.in_use_bytes

    def close(self) -> None:
        """Release the host pool's slabs. Blocks that live graphs still use keep their
        own slab until those graphs die. Safe to repeat; the offloader stays usable (a
        new pool is made on demand)."""
        rt = self._rt
        with rt.lock:
            if rt._pool is not None:
                rt.drain()
                rt._pool.close()

    # ---- the checkpoint ------------------------------------------------------------

    def checkpoint(
        self,
        function: Callable[..., Any],
        *args: Any,
        use_reentrant: bool | None = False,
        **kwargs: Any,
    ) -> Any:
        """:func:`offload.checkpoint` with this offloader's settings, pool and stats."""
        if not callable(function):
            raise TypeError(
                f"function must be callable (a module or a function, as for "
                f"torch.utils.checkpoint.checkpoint); got {type(function).__name__} "
                f"{function!r:.80}"
            )
        _check_use_reentrant(use_reentrant)
        torch_kwargs = {k: kwargs.pop(k) for k in _TORCH_KWARGS if k in kwargs}
        if torch.compiler.is_compiling():
            # Traced by dynamo (the call is inside a compiled module): torch's own
            # checkpoint, which dynamo compiles with the function. Asked first: dynamo
            # cannot trace in_backward() (a graph break).
            if not _traced_warned and torch.is_grad_enabled():
                _warn_traced()  # once: dynamo guards on the flag, later traces skip this
            return _torch_ckpt.checkpoint(
                function, *args, use_reentrant=False, **torch_kwargs, **kwargs
            )
        if not torch.is_grad_enabled() or in_backward() or opted_out():
            # No backward to recompute for / a checkpoint nested in a recomputation /
            # opted out: torch's own checkpoint, unchanged.
            return _torch_ckpt.checkpoint(
                function, *args, use_reentrant=False, **torch_kwargs, **kwargs
            )
        spec, leaves = flatten(args, kwargs)
        rt = self._rt
        record = Record(rt, function, spec)
        try:
            torch_args = stash(rt, record, leaves, self.min_tensor_bytes)
            record.forward_call = (args, kwargs)
            out = _torch_ckpt.checkpoint(record, *torch_args, use_reentrant=False, **torch_kwargs)
        except BaseException:
            record.abort()
            raise
        record.forward_call = None
        release(record, leaves)
        del leaves, torch_args
        outputs = grad_tensors(out)
        if outputs and self.prefetch_layers > 0:
            hook = functools.partial(backward_started, weakref.ref(record), self.prefetch_layers)
            torch.autograd.graph.register_multi_grad_hook(outputs, hook, mode="any")
        last = getattr(self._local, "last", None)
        record.prev = last
        self._local.last = weakref.ref(record)
        return out


_traced_warned = False


def _warn_traced_impl() -> None:
    global _traced_warned
    _traced_warned = True
    warn_at_caller(
        "offload.checkpoint was called inside code that torch.compile traces (e.g. a "
        "layer compiled with layer.compile() whose forward checkpoints itself, as Hugging "
        "Face's GradientCheckpointingLayer does): there it runs torch's own checkpoint, "
        "compiled with the layer, and its inputs stay on the device. To keep them in "
        "host memory, call offload.checkpoint outside the compiled code, on the compiled "
        "module: offload.checkpoint(compiled_layer, x)."
    )


def _warn_traced() -> None:
    from offload._core._dynamo import eager

    eager(_warn_traced_impl)()


# --------------------------------------------------------------------------------------
# the process-wide default

_default: CheckpointOffloader | None = None
_default_lock = threading.Lock()


def _default_offloader() -> CheckpointOffloader:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = CheckpointOffloader()
    return _default


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = False,
    **kwargs: Any,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` and keep its inputs in host memory.

    A drop-in for ``torch.utils.checkpoint.checkpoint(function, *args,
    use_reentrant=False, **kwargs)``: the same outputs, the same gradients (bitwise), the
    same recomputation in backward. The difference is where the inputs wait for the
    backward. Torch keeps every checkpointed call's inputs on the device; here each
    tensor argument (positional, keyword, or nested in tuples, lists and dicts) is
    copied to pinned host memory on a side stream as the call starts, the checkpoint
    keeps no reference to the device tensor (so it is freed as soon as the caller drops
    it), and the bytes come back before the recomputation: prefetched when the backward
    of the next checkpointed call starts (``prefetch_layers``), or on demand. Without an
    accelerator the same steps run synchronously into host pool buffers.

    What stays on the device (counted in :func:`checkpoint_stats`, ``bytes_kept``):
    ``nn.Parameter`` arguments, tensors smaller than ``min_tensor_bytes`` (256 KiB),
    tensor subclasses, tensors on another device, tensors marked ``_do_not_offload``,
    everything inside :func:`offload.no_offload`, and whatever ``function`` captures
    itself (closures, ``functools.partial`` arguments: Hugging Face binds the keyword
    arguments of its layers, e.g. position embeddings and the attention mask, that way).
    Calls without gradients (``torch.no_grad()``), calls made inside a backward (a
    checkpoint nested in a recomputation) and calls traced by ``torch.compile`` (made
    inside compiled code, e.g. a layer compiled with ``layer.compile()`` that
    checkpoints its own body; one warning) run torch's own checkpoint. Called on a
    compiled layer from outside it, the inputs are offloaded as usual.

    Settings and stats belong to a process-wide :class:`CheckpointOffloader` with its
    defaults; make your own and call its ``checkpoint`` method to change them. Bytes
    moved here are not counted in an :class:`offload.ActivationOffloader`'s stats (an
    offloader active around the call sees only the 0-byte placeholders); read them with
    :func:`checkpoint_stats`. An input changed in place *during* the call makes the
    recomputation raise autograd's "modified by an inplace operation" error, as torch
    would; a change made after the call returned cannot be seen (torch would raise).

    Args:
        function: what to run, as for torch: ``function(*args, **kwargs)``.
        *args: positional arguments of ``function``.
        use_reentrant: must be ``False`` (default) or ``None`` (taken as ``False``).
        preserve_rng_state: keyword, passed to torch. Stash and restore the RNG states
            (CPU, and the device of the inputs) so that dropout recomputes the same mask.
            Default ``True``.
        determinism_check: keyword, passed to torch. ``"default"`` (compare shape, dtype
            and device of what the recomputation saves) or ``"none"``. Default
            ``"default"``.
        context_fn: keyword, passed to torch. A callable returning two context managers,
            for the forward and the recomputation (selective checkpointing). Default:
            none.
        debug: keyword, passed to torch. Trace the operators for error messages. Default
            ``False``.
        early_stop: keyword, passed to torch. Stop the recomputation once everything
            needed is recomputed. Default ``True``.
        **kwargs: every other keyword argument goes to ``function``.

    Returns:
        Whatever ``function(*args, **kwargs)`` returns.

    Raises:
        ValueError: ``use_reentrant=True`` (use ``torch.utils.checkpoint.checkpoint``
            for the reentrant variant), or an invalid ``determinism_check`` (from
            torch).
        TypeError: ``function`` is not callable, or ``use_reentrant`` is not a bool or
            ``None``.
        RuntimeError: in backward, when the forward of this call raised, or when an input
            was modified in place during the call.

    Example:
        >>> import offload, torch
        >>> _ = offload.checkpoint_stats(reset=True)  # counters start at zero
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))
        >>> x = torch.randn(512, 256, requires_grad=True)  # 512 KiB per layer input
        >>> h = x
        >>> for layer in layers:
        ...     h = offload.checkpoint(layer, h)
        >>> h.square().mean().backward()
        >>> stats = offload.checkpoint_stats(reset=True)
        >>> stats.bytes_offloaded == 4 * x.nbytes == stats.bytes_reloaded
        True
        >>> stats.reloads_prefetched, stats.reloads_on_demand
        (3, 1)
    """
    return _default_offloader().checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def checkpoint_stats(reset: bool = False) -> CheckpointStats:
    """The stats of :func:`checkpoint` (the process-wide :class:`CheckpointOffloader`).

    Args:
        reset: zero the counters after reading them. Default ``False``.

    Returns:
        A :class:`CheckpointStats` copy: bytes offloaded, shared, reloaded and kept (by
        reason), calls, prefetched and on-demand reloads, host pool figures.

    Example:
        >>> import offload
        >>> offload.checkpoint_stats().bytes_offloaded >= 0
        True
    """
    offloader = _default_offloader()
    stats = offloader.stats
    if reset:
        offloader.reset_stats()
    return stats
