"""The public front of weight offloading (docs/design.md 4.10): :class:`WeightOffloader`,
which keeps layers' parameters in host memory between their uses. The work is done by
the other modules of ``offload/weights/``; ``# Note [weight residency]`` in
``_residency.py`` says when each weight is on the device and why every wait is safe."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from offload.weights._host_grads import push as _push
from offload.weights._init import check_tied
from offload.weights._lifecycle import close as _close
from offload.weights._lifecycle import create as _create
from offload.weights._lifecycle import populate as _populate

__all__ = ["WeightOffloader"]


class WeightOffloader:
    """Keep the parameters of ``layers`` in host memory; bring each layer's weights to the
    device just before its forward and its backward, and free them right after.

    At construction every parameter of ``layers`` is copied to pinned host memory (one
    copy per parameter, in shared slabs) and its device storage is freed in place
    (``untyped_storage().resize_(0)``). The ``Parameter`` objects stay the same, so
    optimizers, state dict keys, autograd and weak references keep working. Before a
    layer's forward (a forward pre-hook) and before its backward (a hook on its output
    gradients) the storage is refilled by a host-to-device copy on a side stream,
    issued ``prefetch_layers`` layers ahead so that it overlaps the compute of the
    layers before; the compute stream waits for the copy on the device, never on the
    host. After the layer's forward, and after its backward, the storage is freed again.
    ``# Note [weight residency]`` in ``offload/weights/_residency.py`` says when each weight is on
    the device and why every wait is safe.

    Frozen weights (``requires_grad=False``: inference, LoRA base weights) need nothing
    else. Trainable weights:

    * ``grads="device"``: gradients stay on the device as usual (``p.grad``, or the
      fused layers' ``main_grad``). The weights are not on the device outside their
      layer, so run the optimizer step (or any other use of the weights) inside
      ``with offloader.resident():``: every offloaded weight comes back, and what the
      step changed is copied back to the host when the block ends.
    * ``grads="host"``: each trainable parameter gets an fp32 master copy and an fp32
      ``main_grad`` in host memory. As each layer's backward ends, its gradients are
      copied to the host and added into ``main_grad`` (written instead with the
      parameter attribute ``overwrite_main_grad=True``); ``p.grad`` stays ``None``.
      ``backward()`` returns once every ``main_grad`` is complete. Step a CPU optimizer
      on :meth:`host_parameters` (whose ``.grad`` is ``main_grad``) and call
      :meth:`push` to copy the updated masters into the host weights the next refills
      read::

          opt = torch.optim.AdamW(offloader.host_parameters(), lr=1e-4)
          loss.backward()
          opt.step(); opt.zero_grad(); offloader.push()

    Use with :class:`offload.ActivationOffloader` on the same layers is supported: the
    activation offloader recognises the refilled weights (and their ``weight.t()``
    views) as parameters on every forward and never moves them.

    ``model.state_dict()`` returns the offloaded parameters as full CPU tensors: views of
    the host copies (brought up to date first when a layer changed on the device), also
    with ``keep_vars=True``. ``model.load_state_dict(sd)`` (not ``assign=True``) fills
    each layer on the device, one at a time, and writes it back to the host. Call
    :meth:`close` (or leave the ``with`` block) before moving, casting, copying or
    re-sharding the model: it puts every parameter back on the device. The offloader
    also closes itself when garbage collected, so keep a reference to it.

    **Outside its layer** (its forward, its backward, :meth:`resident`) an offloaded
    parameter has no data on the device. Do not read it there: printing it,
    ``copy.deepcopy(model)``, ``model.to(...)``, a tied use by another module (an
    embedding tied to an offloaded head). PyTorch does not check storage sizes in most
    kernels, so such a read may crash the process (a segmentation fault on the CPU, an
    illegal memory access on CUDA) instead of raising. ``optimizer.step()`` over such
    parameters is refused with a ``RuntimeError`` (a global optimizer step pre-hook);
    :meth:`check` finds parameters tied to modules outside ``layers``.

    Without an accelerator (parameters on the CPU) the same logic runs synchronously
    with plain CPU tensors: nothing is saved, and every decision is testable in CI.

    Args:
        layers: the modules whose parameters are offloaded, in call order (e.g.
            ``model.layers`` or :func:`offload.find_layers`). A module given twice is
            offloaded once; a module without parameters is skipped.
        prefetch_layers: how many layers ahead (forward) or behind (backward) a layer's
            weights are copied to the device; the last ``prefetch_layers`` layers also
            stay on the device from their forward to their backward. ``0`` copies each
            layer when it starts (no overlap). Default ``1``: at most two layers'
            weights on the device at any time.
        grads: ``"device"`` (default) or ``"host"``, see above.
        pin_memory: page-lock the host copies and gradient staging buffers, so copies
            run asynchronously at full speed. Default ``True``; ignored without an
            accelerator.

    Raises:
        TypeError: ``layers`` is not a sequence of ``nn.Module``; ``prefetch_layers`` is
            not an int; ``grads`` not a str; ``pin_memory`` not a bool.
        ValueError: ``layers`` is empty or holds no parameter; ``prefetch_layers < 0``;
            ``grads`` not ``"device"`` or ``"host"``; a parameter is shared by two of
            ``layers`` (tied weights) or its storage holds more than this layer's
            parameters; a parameter is on the meta device, on a device other than the
            CPU or CUDA, or on another device than the other offloaded ones; a
            parameter is a tensor subclass, or its storage cannot be resized; a layer is
            managed by FSDP2 (use ``torch.distributed.fsdp.CPUOffloadPolicy``);
            ``grads="host"`` and a fused layer's weight already has a ``main_grad``.
        RuntimeError: the host refuses the pinned memory.

    Attributes:
        refills: host-to-device refills issued so far.
        refills_on_demand: those issued when their layer was already starting (not
            prefetched, so the copy could not overlap compute; the first layer of each
            forward always is).
        max_resident_layers: most layers whose weights were on the device at once.

    Example:
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        >>> offloader = WeightOffloader(layers)
        >>> layers[0].weight.untyped_storage().nbytes()   # not on the device
        0
        >>> y = torch.randn(8, 64)
        >>> for layer in layers:
        ...     y = layer(y)                 # each layer's weights come back for its call
        >>> y.square().mean().backward()     # ... and for its backward
        >>> layers[0].weight.grad.shape
        torch.Size([64, 64])
        >>> with offloader.resident():       # optimizer steps need the weights
        ...     torch.optim.SGD(layers.parameters(), lr=0.1).step()
        >>> offloader.close()                # every parameter back on the device
        >>> layers[0].weight.untyped_storage().nbytes()
        16384
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        prefetch_layers: int = 1,
        grads: str = "device",
        pin_memory: bool = True,
    ) -> None:
        self._layers, self._hooks = _create(prefetch_layers, grads, pin_memory)
        _populate(self._layers, self._hooks, layers)

    @classmethod
    def _empty(cls, prefetch_layers: int = 1, grads: str = "device", pin_memory: bool = True):
        """An offloader with no layer yet; ``get_cpu_offload_context`` adopts them."""
        self = cls.__new__(cls)
        self._layers, self._hooks = _create(prefetch_layers, grads, pin_memory)
        return self

    # ---- settings and counters (read from the layers' shared state) --------------------

    @property
    def prefetch_layers(self) -> int:
        """How many layers ahead (forward) or behind (backward) weights are copied."""
        return self._layers.prefetch_layers

    @property
    def grads(self) -> str:
        """Where gradients go: ``"device"`` or ``"host"``."""
        return self._layers.grads

    @property
    def pin_memory(self) -> bool:
        """Whether the host copies are page-locked."""
        return self._layers.pin_memory

    @property
    def refills(self) -> int:
        """Host-to-device refills issued so far."""
        return self._layers.refills

    @property
    def refills_on_demand(self) -> int:
        """Refills issued when their layer was already starting (not prefetched)."""
        return self._layers.refills_on_demand

    @property
    def max_resident_layers(self) -> int:
        """Most layers whose weights were on the device at once so far."""
        return self._layers.max_resident_layers

    @property
    def _backend(self) -> Any:
        return self._layers.backend

    @property
    def _grad_pool(self) -> Any:
        grads = self._layers.host_grads
        return None if grads is None else grads.pool

    # ---- public ----------------------------------------------------------------------

    @contextlib.contextmanager
    def resident(self, parameters: Iterable[torch.Tensor] | None = None) -> Iterator[None]:
        """Bring offloaded weights to the device for the block; write changes back after.

        Inside the block the layers holding ``parameters`` (default: every offloaded
        layer) are on the device, as without offloading. When it ends, the layers whose
        parameters changed (their version counters moved: an optimizer step,
        ``copy_``, ``mul_``) are copied back to the host; then all are freed again. Use
        it around a device optimizer's ``step()`` with ``grads="device"``, or to inspect
        or edit weights. It needs the device memory of every layer it brings back.

        Args:
            parameters: limit it to the layers that hold any of these tensors (e.g. the
                trainable ones, for a LoRA optimizer). Default ``None``: all layers.

        Raises:
            RuntimeError: the offloader is closed.

        Example:
            >>> layers = [torch.nn.Linear(4, 4) for _ in range(2)]
            >>> offloader = WeightOffloader(layers)
            >>> with offloader.resident(), torch.no_grad():
            ...     _ = layers[1].weight.mul_(2)     # copied back to the host at the end
            >>> offloader.close()
        """
        layers = self._layers
        if layers.closed:
            raise RuntimeError("this WeightOffloader is closed: its parameters are on the device")
        if parameters is None:
            slots = list(layers.order)
        else:
            wanted = {id(t) for t in parameters}
            slots = [s for s in layers.order if any(id(p.param) in wanted for p in s.params)]
        for s in slots:
            layers.hold(s)
        try:
            yield
        finally:
            for s in slots:
                layers.unhold(s)

    def host_parameters(self) -> list[torch.Tensor]:
        """The fp32 host master copy of every trainable offloaded parameter
        (``grads="host"``), in :meth:`parameters` order; each one's ``.grad`` is its
        host ``main_grad``.

        Hand them to a CPU optimizer (``torch.optim.AdamW(offloader.host_parameters())``)
        and call :meth:`push` after each ``step()``. ``optimizer.zero_grad()`` may set the
        ``.grad`` to ``None``: the next backward then writes ``main_grad`` afresh and
        puts it back. Parameters outside ``layers`` keep their gradients on the device:
        give them to an optimizer of their own.

        Raises:
            RuntimeError: ``grads`` is not ``"host"``.

        Example:
            >>> layers = [torch.nn.Linear(4, 4) for _ in range(2)]
            >>> offloader = WeightOffloader(layers, grads="host")
            >>> [tuple(t.shape) for t in offloader.host_parameters()]
            [(4, 4), (4,), (4, 4), (4,)]
            >>> offloader.close()
        """
        if self.grads != "host":
            raise RuntimeError(
                f"host_parameters() needs WeightOffloader(..., grads='host'); this one has "
                f"grads={self.grads!r} (its gradients are on the device)"
            )
        return [
            prm.master for s in self._layers.order for prm in s.params if prm.master is not None
        ]

    def parameters(self) -> list[nn.Parameter]:
        """Every offloaded parameter, in layer order (once each)."""
        return [prm.param for s in self._layers.order for prm in s.params]

    def push(self) -> None:
        """Copy the host masters (after a CPU optimizer step) into the host weights that
        the next refills read (``grads="host"``).

        Waits on the host for copies that may still read those bytes. Layers on the
        device at that moment get the new values too.

        Raises:
            RuntimeError: ``grads`` is not ``"host"``; the offloader is closed.
        """
        if self.grads != "host":
            raise RuntimeError(
                f"push() needs WeightOffloader(..., grads='host'); this one has "
                f"grads={self.grads!r} (step the optimizer inside offloader.resident())"
            )
        if self._layers.closed:
            raise RuntimeError("this WeightOffloader is closed: push() has nothing to update")
        _push(self._layers)

    def check(self, model: nn.Module) -> None:
        """Raise if a parameter of an offloaded layer is also used by a module of
        ``model`` outside ``layers`` (a tied embedding and head, a shared projection):
        there it would find no data on the device.

        Args:
            model: the model that contains ``layers``.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: such a parameter exists; the message names both places.
        """
        check_tied(self._layers, model)

    @property
    def bytes_offloaded(self) -> int:
        """Device bytes of the offloaded weights (freed between their uses)."""
        return sum(s.nbytes for s in self._layers.order)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes this offloader holds (weights and gradient staging;
        pinned slabs are powers of two, so this may exceed the weights' bytes)."""
        if not (self.pin_memory and torch.cuda.is_available()):
            return 0
        return sum(p.reserved_bytes for p in self._pools() if p is not None)

    @property
    def host_bytes(self) -> int:
        """Host bytes this offloader holds: weight slabs, gradient staging, and with
        ``grads="host"`` the fp32 masters and ``main_grad``."""
        total = sum(p.reserved_bytes for p in self._pools() if p is not None)
        for s in self._layers.order:
            for prm in s.params:
                for t in (prm.master, prm.main_grad):
                    if t is not None:
                        total += t.nbytes
        return total

    def _pools(self) -> tuple[Any, Any]:
        return self._layers.pool, self._grad_pool

    @property
    def resident_layers(self) -> list[int]:
        """Indices (into ``layers``) of the layers whose weights are on the device now."""
        return [s.index for s in self._layers.order if s.resident]

    def close(self) -> None:
        """Put every parameter back on the device and remove every hook. Idempotent; also
        runs when the ``with`` block ends and when the offloader is garbage collected.

        The host copies are freed; with ``grads="host"`` the masters and ``main_grad``
        stay readable through :meth:`host_parameters`.
        """
        if not self._layers.closed:
            _close(self._layers, self._hooks)

    def __enter__(self) -> WeightOffloader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, or __init__ raised before any state
            pass

    def __repr__(self) -> str:
        state = "closed" if self._layers.closed else f"{len(self._layers.order)} layers"
        return (
            f"WeightOffloader({state}, {self.bytes_offloaded} bytes, "
            f"prefetch_layers={self.prefetch_layers}, grads={self.grads!r}, "
            f"pin_memory={self.pin_memory})"
        )
