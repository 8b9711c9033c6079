"""Weight offloading: the implementation of :class:`offload.WeightOffloader`
(docs/design.md 4.10).

The layers' parameters live in host memory; their device storage exists only while a
layer runs (forward or backward) or is about to. Numbers like 4.1(e) refer to the
ordering invariants of ``docs/design.md``, section 4; streams and events are reached
through ``_device.py``'s backends, pinned memory through ``_host_pool.py``.

Note [weight residency]
~~~~~~~~~~~~~~~~~~~~~~~
This note answers "when is a weight on the device, and why is each wait safe?".

Each offloaded layer (a *slot*) owns the device storages of its parameters and one host
copy of each (a block of a ``HostPool``: pinned slabs shared by many weights). The
``Parameter`` objects never change; only their storage is resized in place
(``untyped_storage().resize_(n)``, FSDP2's trick), so autograd's ``AccumulateGrad``
nodes, optimizer state keys, the weak references of the fused layers and saved
``weight.t()`` views (which share the storage) stay valid. Refills write through a
separate byte tensor over the storage, so the parameters' version counters (which
autograd and the fused layers check) do not move.

*When a slot is resident.* While anything holds it:

- ``fwd``: its forward runs (forward pre-hook to forward hook);
- ``want_fwd``: prefetched for a forward that has not reached it yet (issued at the
  forward pre-hook of the layer ``prefetch_layers`` positions before it);
- ``bwd`` / ``bwd_active``: its backward started (a hook on the gradient of the layer's
  outputs) and is not over. It is over when the gradients of all its inputs that
  require grad have arrived *and* every parameter that gets a ``.grad`` ran its
  post-accumulate-grad hook (either alone when the other does not apply), or when the
  backward ends (a callback queued on autograd's engine frees whatever is left);
- ``want_bwd``: prefetched for a backward (at the backward of the layer
  ``prefetch_layers`` positions after it); or, for the last ``prefetch_layers`` layers,
  kept after a forward whose outputs require grad (their backward comes first);
- ``ext``: :meth:`WeightOffloader.resident` and ``load_state_dict``.

When the last hold goes, the slot is freed at once. A forward that raises drops the
forward prefetches; a backward that raises is cleaned up by the next forward.

*Refill*, on the compute stream C (the stream current where the hook runs):

1. ``resize_(nbytes)`` allocates a block from C's pool of the caching allocator. The
   block may have been freed a moment ago while kernels that used it are still queued on
   C: the allocator reuses blocks in stream order, which is safe for later work on C
   only.
2. The H2D stream waits for C (everything queued on C so far) and for the slot's last
   write-back (step 5: the host bytes must be complete), copies host to device and
   records the ready event R. So the copy writes the block only after every earlier
   kernel of C that used it (as 4.1(e) for reload buffers).
3. Before the layer's kernels are enqueued (forward pre-hook, backward pre-hook), C
   waits for R on the device (``wait_event``): no kernel reads the weight before the
   copy wrote it (4.1(c)). The host never waits.

*Free*, at the forward hook, when the layer's backward is over, or when a hold ends:

4. If C never waited for R (a prefetch that was not used), C waits for it now, so the
   block cannot be handed to a later kernel of C while the copy still writes it.
5. If a parameter's version counter moved since the refill (an optimizer step inside
   ``resident()``, ``load_state_dict``), the bytes are first copied back to the host on
   the D2H stream, which waits for C (4.1(a)), and C waits for that copy (4.1(b)).
6. ``resize_(0)`` on the host thread, after the kernels that read the weight were
   enqueued on C: the block returns to C's pool and the allocator hands it only to
   kernels enqueued later on C, which run after those readers. (When the current
   stream is not C, C first waits for it.)

Host code that touches a host copy (``push()``, ``state_dict()``) first waits on the
host for the last H2D, which may still read it, and the last write-back, which may
still write it.

*Gradients with* ``grads="host"``:

7. The post-accumulate-grad hook copies ``p.grad`` into a pinned staging block on the
   D2H stream (which waits for C, so after ``AccumulateGrad`` wrote it), records event
   G and sets ``p.grad = None``, but keeps the device tensor: C waits for G and drops it
   when the next layer's backward is over (or the backward ends), so its block is not
   reused while the copy reads it (4.1(b)).
8. A worker thread waits for G on the host, adds the staging bytes into the fp32
   ``main_grad`` (copies them with ``overwrite_main_grad``) and returns the block to the
   pool. The end of each backward waits for the worker: ``main_grad`` is complete when
   ``backward()`` returns. Fused layers (``fuse_wgrad_accumulation=True``) write dW into
   a device staging ``main_grad`` (zeroed when the layer's backward starts), which goes
   the same way when it ends.

*CPU path* (parameters on the CPU, e.g. a machine without an accelerator): the same
logic with ``SyncBackend``: copies happen at once, events are ``None``, nothing waits,
gradients are added directly. It saves no memory and exists so every decision runs in
CI.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from offload import _packing
from offload._device import Backend, backend_for
from offload._host_pool import HostBlock, HostPool, _next_pow2
from offload._scheduler import in_backward as _in_backward
from offload._warn import warn_at_caller

__all__ = ["WeightOffloader", "manual_weight_context"]

GRADS = ("device", "host")
_NO_LIMIT = 1 << 62  # the weights must fit: no budget, a refusal is an error
_MAX_SLAB = 256 << 20  # slabs of 256 MiB: several weights share one, little is wasted


#: Live offloaders, for the optimizer guard below.
_LIVE: weakref.WeakSet[WeightOffloader] = weakref.WeakSet()
_GUARD: list[Any] = []


def _install_optimizer_guard() -> None:
    """Once per process: a global optimizer step pre-hook that refuses a step over
    offloaded parameters that have a gradient but are not on the device (it would read
    empty storages: PyTorch does not check, and the process may crash)."""
    if not _GUARD:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _GUARD.append(register_optimizer_step_pre_hook(_optimizer_guard))


def _optimizer_guard(optimizer: Any, args: Any, kwargs: Any) -> None:
    for off in list(_LIVE):
        owners = off._owners
        if off._closed or not owners:
            continue
        for group in optimizer.param_groups:
            for p in group["params"]:
                slot = owners.get(id(p))
                # parameters without a gradient are skipped by the step (a frozen base)
                if slot is not None and not slot.resident and p.grad is not None:
                    raise RuntimeError(
                        f"offload: {type(optimizer).__name__}.step() over a parameter of "
                        f"{slot.where}, whose weights are offloaded (no data on the device "
                        f"outside its layer). Step inside `with offloader.resident():` "
                        f"(grads='device'), or step a CPU optimizer on "
                        f"offloader.host_parameters() and call offloader.push() "
                        f"(grads='host')"
                    )


_tensors_in = _packing.tensors_requiring_grad


def _fused_weights(module: nn.Module) -> set[int]:
    """ids of the weights whose gradient a fused layer writes into ``main_grad``
    (``offload.nn.Linear`` / ``GroupedLinear`` and TransformerEngine-style modules with
    ``fuse_wgrad_accumulation=True``): they get no ``.grad``."""
    ids: set[int] = set()
    for m in module.modules():
        if getattr(m, "fuse_wgrad_accumulation", False) is True:
            for name, p in m.named_parameters(recurse=False):
                if name.startswith("weight"):
                    ids.add(id(p))
    return ids


def _fsdp_message(where: str) -> str:
    return (
        f"{where} is managed by FSDP2 (fully_shard): its parameters are DTensor shards "
        f"that FSDP frees and all-gathers itself, so WeightOffloader cannot move them. "
        f"Use FSDP2's own offloading: fully_shard(module, "
        f"offload_policy=torch.distributed.fsdp.CPUOffloadPolicy())"
    )


def _check_not_fsdp(module: nn.Module, where: str) -> None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        FSDPModule = None  # noqa: N806
    for m in module.modules():
        if FSDPModule is not None and isinstance(m, FSDPModule):
            raise ValueError(_fsdp_message(where))
    for p in module.parameters():
        if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor":
            raise ValueError(_fsdp_message(where))


# --------------------------------------------------------------------------------------
# the objects of one offloader


class _Plan:
    """What :meth:`WeightOffloader._inspect` found in one layer, before anything moved."""

    __slots__ = ("index", "module", "where", "stores", "device", "named", "fused")

    def __init__(self, index: int, module: nn.Module, where: str) -> None:
        self.index = index
        self.module = module
        self.where = where
        # storage key -> (storage, nbytes, [(name, parameter)])
        self.stores: dict[int, tuple[torch.UntypedStorage, int, list[tuple[str, Any]]]] = {}
        self.device: torch.device | None = None
        self.named: list[tuple[str, nn.Parameter]] = []
        self.fused: set[int] = set()


class _Store:
    """One device storage of a layer's parameters and its host copy."""

    __slots__ = ("storage", "nbytes", "device", "block", "host")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int, dev: torch.device) -> None:
        self.storage = storage  # the parameters' own storage, resized in place
        self.nbytes = nbytes
        # A byte tensor over the storage with a version counter of its own: refills
        # write through it, so the parameters' versions do not move.
        self.device = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
        self.block: HostBlock | None = None
        self.host: torch.Tensor | None = None  # uint8 host bytes (block.tensor)


class _Param:
    """One parameter of a slot: its store, and with grads="host" its master and grads."""

    __slots__ = ("param", "names", "store", "fused", "master", "main_grad", "staging", "live")

    def __init__(self, param: nn.Parameter, name: str, store: _Store, fused: bool) -> None:
        self.param = param
        self.names = [name]  # every name under the slot's module (tied inside the layer)
        self.store = store
        self.fused = fused
        self.master: torch.Tensor | None = None  # fp32 host copy the optimizer updates
        self.main_grad: torch.Tensor | None = None  # fp32 host gradient
        self.staging: torch.Tensor | None = None  # fused + host: device dW buffer
        self.live = False  # the staging buffer holds memory now


class _Slot:
    """One offloaded layer: its storages, parameters and residency (Note [weight
    residency])."""

    def __init__(self, sid: int, index: int, module: nn.Module, where: str) -> None:
        self.sid = sid  # position in the offloader's list of slots
        self.index = index  # position of the module in `layers` (first occurrence)
        self.module = module
        self.where = where
        self.stores: list[_Store] = []
        self.params: list[_Param] = []
        self.expected: set[int] = set()  # ids of params that get a .grad in backward
        self.resident = True
        self.ready: Any = None  # event of the refill's H2D
        self.waited = True  # the compute stream waited for `ready`
        self.stream: Any = None  # compute stream of the refill (the block's pool)
        self.write_event: Any = None  # last write-back D2H into the host copy
        self.versions: list[int] = []
        self.fwd = 0
        self.ext = 0
        self.bwd = 0
        self.want_fwd = False
        self.want_bwd = False
        self.bwd_active = False
        self.bwd_inputs = False
        self.seen: set[int] = set()
        # per forward call in flight: (exception being handled when it began, its
        # position in the call sequence, -1 inside a backward)
        self.frames: list[tuple[BaseException | None, int]] = []
        self.hooks: list[Any] = []

    @property
    def holds(self) -> int:
        return self.fwd + self.ext + self.bwd + self.want_fwd + self.want_bwd + self.bwd_active

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.stores)


class _Call:
    """One call of a slot's module whose outputs require grad: its backward's state."""

    __slots__ = (
        "slot",
        "pos",
        "expected",
        "seen",
        "active",
        "ran",
        "dead",
        "handles",
        "__weakref__",
    )

    def __init__(self, slot: int, pos: int, expected: int) -> None:
        self.slot = slot
        self.pos = pos  # position in the call sequence (-1: called inside a backward)
        self.expected = expected  # inputs that require grad
        self.seen = 0
        self.active = False
        self.ran = False  # its backward started at least once
        self.dead = False  # its graph is gone
        self.handles: list[Any] = []


class _OutputHook:
    """The hook on a call's output gradient (its backward begins). Its death, with the
    graph that holds it, marks the call dead."""

    __slots__ = ("owner", "call", "inputs_of", "__weakref__")

    def __init__(self, owner: weakref.ref, call: _Call) -> None:
        self.owner = owner
        self.call = call
        # Later calls that take this very tensor as input: its gradient completes that
        # input of theirs. Told first, so the layer after is freed before this one's
        # backward refills anything.
        self.inputs_of: list[_Call] = []

    def __call__(self, _grad: Any) -> None:
        off = self.owner()
        if off is not None:
            for call in self.inputs_of:
                off._input_done(call)
            off._backward_start(self.call)


def _mark_dead(call: _Call) -> None:
    call.dead = True


class _GradWorker:
    """A thread that waits for gradient copies on the host and adds them into
    ``main_grad`` (Note [weight residency], 8). Holds no reference to the offloader."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def submit(self, event: Any, job: Any) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._run, name="offload-weight-grads", daemon=True
            )
            self.thread.start()
        self.jobs.put((event, job))

    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            try:
                if item is None:
                    return
                event, job = item
                self.backend.host_wait(event)
                job()
            except BaseException as exc:  # reported by drain()
                self.error = exc
            finally:
                self.jobs.task_done()

    def drain(self) -> None:
        """Wait until every submitted job is done; re-raise a job's error."""
        if self.thread is not None:
            self.jobs.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("offload: adding a gradient into main_grad failed") from error

    def close(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None


def _accumulate(
    master: torch.Tensor, main_grad: torch.Tensor, src: torch.Tensor, overwrite: bool
) -> None:
    """``master.grad += src`` (``= src`` with ``overwrite`` or after ``zero_grad``)."""
    with torch.no_grad():
        dst = master.grad
        if dst is None:  # optimizer.zero_grad(set_to_none=True): start again
            master.grad = dst = main_grad
            overwrite = True
        if overwrite:
            dst.copy_(src)
        else:
            dst.add_(src)


def _grad_job(
    master: torch.Tensor,
    main_grad: torch.Tensor,
    src: torch.Tensor,
    overwrite: bool,
    pool: HostPool,
    block: HostBlock,
) -> None:
    try:
        _accumulate(master, main_grad, src, overwrite)
    finally:
        pool.free(block)


# --------------------------------------------------------------------------------------
# hooks: module-level functions holding a weak reference to the offloader, so that the
# model's hooks do not keep it alive (its __del__ restores the parameters)


def _forward_pre(ref: weakref.ref, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
    off = ref()
    if off is not None and not off._closed:
        off._forward_start(off._slots[index])


def _forward_post(
    ref: weakref.ref, index: int, module: nn.Module, args: Any, kwargs: Any, output: Any
) -> None:
    off = ref()
    if off is not None and not off._closed:
        off._forward_end(off._slots[index], args, kwargs, output)


def _input_grad(ref: weakref.ref, call: _Call, _grad: Any) -> None:
    off = ref()
    if off is not None:
        off._input_done(call)


def _accumulated(ref: weakref.ref, index: int, prm: _Param, param: torch.Tensor) -> None:
    off = ref()
    if off is not None:
        off._param_done(off._slots[index], prm)


def _backward_end(ref: weakref.ref) -> None:
    off = ref()
    if off is not None:
        off._end_backward()


def _state_dict_post(
    ref: weakref.ref, index: int, module: nn.Module, state_dict: Any, prefix: str, meta: Any
) -> None:
    off = ref()
    if off is not None and not off._closed:
        off._fill_state_dict(off._slots[index], state_dict, prefix)


def _load_pre(
    ref: weakref.ref,
    index: int,
    module: nn.Module,
    state_dict: Any,
    prefix: str,
    meta: Any,
    *rest: Any,
) -> None:
    off = ref()
    if off is not None and not off._closed:
        if meta is not None and meta.get("assign_to_params_buffers", False):
            raise RuntimeError(
                "offload: load_state_dict(assign=True) would replace the parameters of an "
                "offloaded layer; call WeightOffloader.close() first, or load with "
                "assign=False (the default)"
            )
        off._hold(off._slots[index])


def _load_post(ref: weakref.ref, index: int, module: nn.Module, incompatible: Any) -> None:
    off = ref()
    if off is not None and not off._closed:
        off._unhold(off._slots[index])


# --------------------------------------------------------------------------------------
# the public class


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
    ``# Note [weight residency]`` in ``offload/_weights.py`` says when each weight is on
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
        self._setup(prefetch_layers, grads, pin_memory)
        modules, every = _check_layers(layers)
        plans = []
        for i, module in modules:
            plan = self._inspect(i, module)
            if plan is not None:
                plans.append(plan)
        if not plans:
            raise ValueError(
                f"layers hold no parameters (all {len(modules)} module(s) have none with "
                f"elements): nothing to offload"
            )
        self._check_shared(plans)
        self._start(plans[0].device)  # type: ignore[arg-type]
        total = sum(n for plan in plans for _st, n, _ps in plan.stores.values())
        self._pool = HostPool(_NO_LIMIT, pin_memory, min(_MAX_SLAB, _next_pow2(max(total, 1))))
        blocks = self._allocate(plans)
        for plan in plans:
            self._install(plan, blocks, running=False)
        self._sequence = [self._modules[id(m)] for m in every if id(m) in self._modules]

    # ---- construction --------------------------------------------------------------

    def _setup(self, prefetch_layers: Any, grads: Any, pin_memory: Any) -> None:
        if isinstance(prefetch_layers, bool) or not isinstance(prefetch_layers, int):
            raise TypeError(
                f"prefetch_layers must be an int >= 0; got {type(prefetch_layers).__name__} "
                f"{prefetch_layers!r}"
            )
        if prefetch_layers < 0:
            raise ValueError(f"prefetch_layers={prefetch_layers}: must be >= 0")
        if not isinstance(grads, str):
            raise TypeError(
                f"grads must be a str, one of {list(GRADS)}; got {type(grads).__name__} {grads!r}"
            )
        if grads not in GRADS:
            raise ValueError(f"grads={grads!r}: must be one of {list(GRADS)}")
        if not isinstance(pin_memory, bool):
            raise TypeError(
                f"pin_memory must be a bool; got {type(pin_memory).__name__} {pin_memory!r}"
            )
        self.prefetch_layers = prefetch_layers
        self.grads = grads
        self.pin_memory = pin_memory
        self._lock = threading.RLock()
        self._closed = False
        self._slots: list[_Slot] = []
        self._order: list[_Slot] = []  # each slot once, in `layers` order
        self._sequence: list[_Slot] = []  # the calls of a forward: `layers` with repeats
        self._cursor = -1  # position of the latest forward call in `_sequence`
        self._ahead: list[_Slot] = []  # the latest forward prefetch
        self._resident = 0  # slots resident now
        self._modules: dict[int, _Slot] = {}  # id(module) -> slot
        self._keys: dict[int, tuple[_Slot, str]] = {}  # storage key -> (slot, param name)
        self._calls: list[_Call] = []
        # id(output tensor) -> (weak reference to it, its _OutputHook): single-tensor
        # hooks, which later calls taking that tensor as input join
        self._out_hooks: dict[int, tuple[weakref.ref, _OutputHook]] = {}
        self._pending: list[tuple[int, Any, Any, Any]] = []  # (slot, event, stream, payload)
        self._cb_queued = False
        self._bwd_running = False
        # backward prefetches waiting for the layer after theirs to be freed:
        # (slot whose backward started, its position, the layer after it)
        self._deferred: list[tuple[_Slot, int, _Slot]] = []
        self._device: torch.device | None = None
        self._backend: Backend | None = None
        self._pool: HostPool | None = None
        self._grad_pool: HostPool | None = None
        self._worker: _GradWorker | None = None
        self._last_h2d: Any = None
        self._ref = weakref.ref(self)
        self._owners: dict[int, _Slot] = {}  # id(parameter) -> its slot
        #: Host-to-device refills issued so far, and those issued only when their layer
        #: was already starting (not prefetched: the copy cannot overlap compute).
        self.refills = 0
        self.refills_on_demand = 0
        #: Most layers on the device at once so far (see ``prefetch_layers``).
        self.max_resident_layers = 0
        _LIVE.add(self)
        _install_optimizer_guard()

    def _inspect(self, index: int, module: nn.Module) -> _Plan | None:
        """Validate one layer; ``None`` when it has no parameter with elements."""
        where = f"layers[{index}] ({type(module).__name__})"
        _check_not_fsdp(module, where)
        plan = _Plan(index, module, where)
        plan.named = list(module.named_parameters(remove_duplicate=False))
        if not any(p.numel() for _, p in plan.named):
            return None
        plan.fused = _fused_weights(module)
        seen: set[int] = set()
        for name, p in plan.named:
            what = f"parameter {name!r} of {where}"
            if not _packing.is_plain(p):
                raise ValueError(
                    f"{what} is a {type(p).__name__}, a tensor subclass: only plain "
                    f"parameters can be offloaded"
                )
            if p.numel() == 0 or id(p) in seen:
                continue
            seen.add(id(p))
            if p.device.type == "meta":
                raise ValueError(f"{what} is on the meta device: materialise the model first")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"{what} is on {p.device}: only CUDA (and CPU) parameters can be offloaded"
                )
            if _packing.unsupported(p):
                raise ValueError(f"{what} has a layout that cannot be offloaded ({p.layout})")
            if plan.device is None:
                plan.device = p.device
            elif p.device != plan.device:
                raise ValueError(
                    f"{what} is on {p.device}, others of {where} on {plan.device}: one "
                    f"device per offloader"
                )
            if (
                self.grads == "host"
                and id(p) in plan.fused
                and p.requires_grad
                and getattr(p, "main_grad", None) is not None
            ):
                raise ValueError(
                    f"{what} is the weight of a fused layer and already has a main_grad: "
                    f"with grads='host' the offloader gives it a device staging main_grad "
                    f"while the layer runs and the gradient ends in the host main_grad of "
                    f"host_parameters(). Do not attach main_grad to offloaded layers, or "
                    f"use grads='device'"
                )
            storage = p.untyped_storage()
            if not storage.resizable():
                raise ValueError(
                    f"{what}: its storage cannot be resized (made from a numpy array or an "
                    f"external buffer?); clone it into a regular tensor first"
                )
            key = storage._cdata
            if key not in plan.stores:
                plan.stores[key] = (storage, storage.nbytes(), [])
            plan.stores[key][2].append((name, p))
        for _storage, nbytes, params in plan.stores.values():
            covered = _covered_bytes([p for _, p in params])
            if covered < nbytes:
                names = ", ".join(repr(n) for n, _ in params)
                raise ValueError(
                    f"parameter(s) {names} of {where} live in a storage of {nbytes} bytes "
                    f"of which they cover {covered}: the rest may belong to other tensors "
                    f"(a flat parameter buffer), which freeing it would destroy"
                )
        return plan

    def _check_shared(self, plans: list[_Plan]) -> None:
        owner = {key: (slot.where, name) for key, (slot, name) in self._keys.items()}
        for plan in plans:
            for key, (_st, _n, params) in plan.stores.items():
                name = params[0][0]
                if key in owner:
                    other, other_name = owner[key]
                    raise ValueError(
                        f"parameter {name!r} of {plan.where} shares its storage with "
                        f"parameter {other_name!r} of {other} (tied or shared weights): a "
                        f"weight used by two offloaded layers cannot be offloaded with "
                        f"either. Untie them, or leave one of the two layers out of `layers`"
                    )
                owner[key] = (plan.where, name)
        devices = {plan.device for plan in plans}
        if self._device is not None:
            devices.add(self._device)
        if len(devices) > 1:
            raise ValueError(
                f"the parameters of `layers` live on {sorted(map(str, devices))}: one "
                f"WeightOffloader per device"
            )

    def _start(self, device: torch.device) -> None:
        if self._backend is not None:
            return
        if device.type == "cpu" and torch.cuda.is_available():
            warn_at_caller(
                "offload: the parameters of `layers` are on the CPU, so WeightOffloader "
                "moves them from CPU memory to CPU memory and saves nothing. Move the "
                "model to the GPU first."
            )
        self._device = device
        self._backend = backend_for(device)
        if self.grads == "host" and self._backend.is_async:
            self._worker = _GradWorker(self._backend)

    def _allocate(self, plans: list[_Plan]) -> dict[int, HostBlock]:
        # Largest storages first: best-fit then packs the slabs more tightly.
        todo = sorted(
            ((n, key) for plan in plans for key, (_st, n, _p) in plan.stores.items()),
            reverse=True,
        )
        blocks: dict[int, HostBlock] = {}
        for nbytes, key in todo:
            block = self._pool.allocate(nbytes)  # type: ignore[union-attr]
            if block is None:
                for b in blocks.values():
                    self._pool.free(b)  # type: ignore[union-attr]
                raise RuntimeError(
                    f"offload: could not get {nbytes} bytes of "
                    f"{'pinned ' if self.pin_memory else ''}host memory for a weight "
                    f"({self._pool.reserved_bytes} bytes reserved so far); free host memory "  # type: ignore[union-attr]
                    f"or offload fewer layers"
                )
            blocks[key] = block
        return blocks

    def _install(self, plan: _Plan, blocks: dict[int, HostBlock], running: bool) -> _Slot:
        """Copy a layer's storages to the host, free them (unless the layer is running
        now: its forward hook frees them) and register the hooks."""
        slot = _Slot(len(self._slots), plan.index, plan.module, plan.where)
        by_param: dict[int, _Param] = {}
        for key, (storage, nbytes, params) in plan.stores.items():
            st = _Store(storage, nbytes, plan.device)  # type: ignore[arg-type]
            st.block = blocks[key]
            st.host = st.block.tensor
            st.host.copy_(st.device)  # synchronous: the weights are on the host after it
            slot.stores.append(st)
            for name, p in params:
                prm = _Param(p, name, st, id(p) in plan.fused)
                by_param[id(p)] = prm
                self._owners[id(p)] = slot
                slot.params.append(prm)
            self._keys[key] = (slot, params[0][0])
        for name, p in plan.named:  # a parameter registered under several names
            prm = by_param.get(id(p))
            if prm is not None and name not in prm.names:
                prm.names.append(name)
        for prm in slot.params:
            p = prm.param
            if not p.requires_grad:
                continue
            if not prm.fused:
                slot.expected.add(id(p))
            if self.grads == "host":
                with torch.no_grad():
                    prm.master = self._host_view(prm).to(torch.float32, copy=True)
                    prm.main_grad = torch.zeros_like(prm.master)
                prm.master.grad = prm.main_grad
                if prm.fused:
                    prm.staging = torch.empty(p.shape, dtype=torch.float32, device=plan.device)
                    prm.staging.untyped_storage().resize_(0)
        slot.versions = [prm.param._version for prm in slot.params]
        slot.stream = self._backend.current_stream()  # type: ignore[union-attr]
        self._slots.append(slot)
        self._resident += 1  # until _free below (or the end of the running call)
        self._modules[id(plan.module)] = slot
        self._order.append(slot)
        if running:  # adopted while it runs: the next call of the sequence
            self._sequence.append(slot)
            self._cursor = len(self._sequence) - 1
            slot.fwd = 1
            slot.frames.append((sys.exc_info()[1], self._cursor))
        else:
            self._free(slot)
        self._register(slot, module_hooks=not running)
        return slot

    def _register(self, slot: _Slot, module_hooks: bool) -> None:
        ref, i, m = self._ref, slot.sid, slot.module
        if module_hooks:
            self._register_forward(i)
        slot.hooks.append(
            m.register_state_dict_post_hook(functools.partial(_state_dict_post, ref, i))
        )
        slot.hooks.append(m.register_load_state_dict_pre_hook(functools.partial(_load_pre, ref, i)))
        slot.hooks.append(
            m.register_load_state_dict_post_hook(functools.partial(_load_post, ref, i))
        )
        for prm in slot.params:
            if prm.param.requires_grad:
                hook = functools.partial(_accumulated, ref, i, prm)
                slot.hooks.append(prm.param.register_post_accumulate_grad_hook(hook))

    def _register_forward(self, i: int) -> None:
        slot, ref = self._slots[i], self._ref
        pre = functools.partial(_forward_pre, ref, i)
        post = functools.partial(_forward_post, ref, i)
        m = slot.module
        slot.hooks.append(m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
        slot.hooks.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))

    # ---- host views ------------------------------------------------------------------

    @staticmethod
    def _host_view(prm: _Param) -> torch.Tensor:
        """The parameter's elements in its host copy (same dtype, shape, strides)."""
        p = prm.param
        base = prm.store.host.view(p.dtype)  # type: ignore[union-attr]
        return base.as_strided(p.size(), p.stride(), base.storage_offset() + p.storage_offset())

    # ---- residency (Note [weight residency]) -------------------------------------------

    def _make_resident(self, slot: _Slot, stream: Any) -> None:
        """Refill a slot's storages (steps 1-2); the caller holds the lock."""
        if slot.resident:
            return
        backend = self._backend
        for st in slot.stores:
            st.storage.resize_(st.nbytes)  # allocated in the current (compute) stream's pool
        waits = [slot.write_event] if slot.write_event is not None else []
        pairs = [(st.host, st.device, None) for st in slot.stores]
        slot.ready = backend.h2d(pairs, waits, stream)  # type: ignore[union-attr]
        if slot.ready is not None:
            self._last_h2d = slot.ready
        slot.waited = slot.ready is None
        slot.stream = stream
        slot.resident = True
        slot.versions = [prm.param._version for prm in slot.params]
        self.refills += 1
        self._resident += 1
        self.max_resident_layers = max(self.max_resident_layers, self._resident)

    def _wait_ready(self, slot: _Slot, stream: Any) -> None:
        """Step 3: ``stream`` waits for the refill before the layer's kernels."""
        if slot.ready is None:
            return
        if not slot.waited or stream != slot.stream:
            self._backend.wait(stream, slot.ready)  # type: ignore[union-attr]
            if stream == slot.stream:
                slot.waited = True

    def _free(self, slot: _Slot) -> None:
        """Steps 4-6; the caller holds the lock."""
        if not slot.resident:
            return
        backend = self._backend
        stream = slot.stream
        if backend.is_async:  # type: ignore[union-attr]
            if not slot.waited and slot.ready is not None:
                backend.wait(stream, slot.ready)  # type: ignore[union-attr]
            current = backend.current_stream()  # type: ignore[union-attr]
            if current is not None and stream is not None and current != stream:
                backend.wait(stream, backend.record(current))  # type: ignore[union-attr]
        if any(prm.param._version != v for prm, v in zip(slot.params, slot.versions)):
            for st in slot.stores:  # write back what changed on the device (step 5)
                backend.d2h([(st.device, st.host, None)], None)  # type: ignore[union-attr]
            event = backend.record_d2h()  # type: ignore[union-attr]
            backend.wait(stream, event)  # type: ignore[union-attr]
            slot.write_event = event
        for st in slot.stores:
            st.storage.resize_(0)
        self._resident -= 1
        slot.resident = False
        slot.ready = None
        slot.waited = True

    def _maybe_free(self, slot: _Slot) -> None:
        if slot.resident and slot.holds == 0 and not self._closed:
            self._free(slot)

    def _prefetch(self, slots: Iterable[_Slot], stream: Any, backward: bool) -> None:
        for s in slots:
            if backward:
                s.want_bwd = True
            else:
                s.want_fwd = True
            self._make_resident(s, stream)

    def _hold(self, slot: _Slot) -> None:
        with self._lock:
            stream = self._backend.current_stream()  # type: ignore[union-attr]
            slot.ext += 1
            self._make_resident(slot, stream)
            self._wait_ready(slot, stream)

    def _unhold(self, slot: _Slot) -> None:
        with self._lock:
            slot.ext = max(0, slot.ext - 1)
            self._maybe_free(slot)

    # ---- forward ---------------------------------------------------------------------

    def _forward_start(self, slot: _Slot) -> None:
        in_backward = _in_backward()
        with self._lock:
            pos = -1 if in_backward else self._advance(slot)
            if not in_backward:
                self._recover(prune=pos <= 0)  # pruning: once per forward
            stream = self._backend.current_stream()  # type: ignore[union-attr]
            slot.frames.append((sys.exc_info()[1], pos))
            slot.want_fwd = False
            slot.fwd += 1
            if not slot.resident:
                self.refills_on_demand += 1
            self._make_resident(slot, stream)
            self._wait_ready(slot, stream)
            n = self.prefetch_layers
            if n and pos >= 0:
                ahead = [s for s in self._sequence[pos + 1 : pos + 1 + n] if s is not slot]
                for s in self._ahead:  # prefetched for calls that did not come
                    if s.want_fwd and s is not slot and all(s is not t for t in ahead):
                        s.want_fwd = False
                        self._maybe_free(s)
                self._ahead = ahead
                self._prefetch(ahead, stream, False)
            if self.grads == "host":
                self._set_staging(slot, allocate=False)

    def _advance(self, slot: _Slot) -> int:
        """The position of this call in the call sequence: the next occurrence of the
        slot after the previous call, else its first one (a new forward)."""
        seq, nxt = self._sequence, self._cursor + 1
        if nxt < len(seq) and seq[nxt] is slot:  # the usual case: the next call in order
            self._cursor = nxt
            return nxt
        for p in itertools.chain(range(nxt, len(seq)), range(min(nxt, len(seq)))):
            if seq[p] is slot:
                self._cursor = p
                return p
        return -1

    def _forward_end(self, slot: _Slot, args: Any, kwargs: Any, output: Any) -> None:
        before, pos = slot.frames.pop() if slot.frames else (None, -1)
        exc = sys.exc_info()[1]
        failed = exc is not None and exc is not before
        in_backward = _in_backward()
        register = not failed and torch.is_grad_enabled()
        outputs = _tensors_in(output, []) if register else []
        with self._lock:
            slot.fwd = max(0, slot.fwd - 1)
            if failed and not in_backward:
                for s in self._order:  # forward prefetches that will not be used
                    if s.want_fwd:
                        s.want_fwd = False
                        self._maybe_free(s)
            if outputs and pos >= 0 and pos >= len(self._sequence) - self.prefetch_layers:
                slot.want_bwd = True  # its backward comes right after the forward
            if self.grads == "host" and not slot.bwd_active:
                self._unset_staging(slot)
            self._maybe_free(slot)
        if outputs:
            self._register_backward(slot, pos, args, kwargs, outputs)

    def _register_backward(
        self, slot: _Slot, pos: int, args: Any, kwargs: Any, outputs: list
    ) -> None:
        inputs = _tensors_in((args, kwargs), [])
        call = _Call(slot.sid, pos, len(inputs))
        hook = _OutputHook(self._ref, call)
        for t in inputs:
            entry = self._out_hooks.get(id(t))
            if entry is not None and entry[0]() is t:  # the output of an earlier call
                entry[1].inputs_of.append(call)
            else:
                call.handles.append(
                    t.register_hook(functools.partial(_input_grad, self._ref, call))
                )
        # An in-place op on an output that is a view (x += r on a reshaped GEMM result,
        # inside the layer or after it) rebases the view's history: the node a hook on
        # the view sits on leaves the graph, but the base's earlier node stays. So the
        # bases of view outputs are watched too; the first gradient to arrive triggers.
        targets: dict[int, torch.Tensor] = {}
        for t in outputs:
            targets[id(t)] = t
            base = t._base
            if base is not None and base.requires_grad:
                targets[id(base)] = base
        if len(targets) == 1:
            outputs[0].register_hook(hook)
            self._out_hooks[id(outputs[0])] = (weakref.ref(outputs[0]), hook)
        else:
            torch.autograd.graph.register_multi_grad_hook(list(targets.values()), hook, mode="any")
        weakref.finalize(hook, _mark_dead, call)
        with self._lock:
            self._calls.append(call)

    # ---- backward --------------------------------------------------------------------

    def _queue_end(self) -> None:
        if self._cb_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_backward_end, self._ref)
            )
            self._cb_queued = True
        except RuntimeError:  # not inside a backward: nothing to end
            pass

    def _backward_start(self, call: _Call) -> None:
        with self._lock:
            if self._closed or call.active:
                return
            slot = self._slots[call.slot]
            self._queue_end()
            self._bwd_running = True
            call.active = True
            call.ran = True
            call.seen = 0
            if not slot.bwd_active:
                slot.bwd_active = True
                slot.bwd_inputs = False
                slot.seen.clear()
            if call.expected:
                slot.bwd += 1
                slot.bwd_inputs = True
            slot.want_bwd = False
            stream = self._backend.current_stream()  # type: ignore[union-attr]
            if not slot.resident:
                self.refills_on_demand += 1
            self._make_resident(slot, stream)
            self._wait_ready(slot, stream)
            if self.grads == "host":
                self._set_staging(slot, allocate=True)
            if self.prefetch_layers and call.pos > 0:
                # The layer after this one usually ends its backward a moment later (the
                # gradient that starts this layer completes that one's inputs): prefetch
                # once it is freed, so at most prefetch_layers + 1 layers are resident.
                pos = call.pos
                after = self._sequence[pos + 1] if pos + 1 < len(self._sequence) else None
                if after is not None and after is not slot and after.bwd_active:
                    self._deferred.append((slot, pos, after))
                else:
                    self._prefetch_behind(slot, call.pos, stream)
            if not call.expected:
                call.active = False
            self._check_done(slot)

    def _prefetch_behind(self, slot: _Slot, pos: int, stream: Any) -> None:
        behind = self._sequence[max(0, pos - self.prefetch_layers) : pos]
        self._prefetch([s for s in reversed(behind) if s is not slot], stream, True)

    def _input_done(self, call: _Call) -> None:
        with self._lock:
            if self._closed or not call.active:
                return
            call.seen += 1
            if call.seen >= call.expected:
                call.active = False
                slot = self._slots[call.slot]
                slot.bwd = max(0, slot.bwd - 1)
                self._check_done(slot)

    def _param_done(self, slot: _Slot, prm: _Param) -> None:
        with self._lock:
            if self._closed:
                return
            if self.grads == "host":
                self._grad_to_host(slot, prm)
            p = prm.param
            if slot.bwd_active and id(p) in slot.expected:
                slot.seen.add(id(p))
                self._check_done(slot)

    def _check_done(self, slot: _Slot) -> None:
        """The slot's backward is over when its calls' input gradients are complete and
        every parameter that gets a ``.grad`` has accumulated it."""
        if not slot.bwd_active or slot.bwd > 0:
            return
        if slot.expected:
            if not slot.expected <= slot.seen:
                return
        elif not slot.bwd_inputs:
            return  # nothing tells when: the end of the backward frees it
        slot.bwd_active = False
        self._flush_staging(slot)
        self._release_pending(keep=slot.sid)
        self._maybe_free(slot)
        if self._deferred:
            stream = self._backend.current_stream()  # type: ignore[union-attr]
            rest = []
            for waiting, pos, blocker in self._deferred:
                if blocker.bwd_active:
                    rest.append((waiting, pos, blocker))
                elif waiting.bwd_active:  # still needs the layers before it
                    self._prefetch_behind(waiting, pos, stream)
            self._deferred = rest

    def _end_backward(self) -> None:
        """Queued on autograd's engine at the first hook of a backward: runs when it ends."""
        with self._lock:
            self._cb_queued = False
            self._cleanup_backward()
        if self._worker is not None:
            self._worker.drain()

    def _cleanup_backward(self) -> None:
        """Free what the last backward left (lock held)."""
        self._bwd_running = False
        self._deferred = []
        self._out_hooks = {k: v for k, v in self._out_hooks.items() if v[0]() is not None}
        for slot in self._slots:
            if slot.bwd_active or slot.bwd:
                self._flush_staging(slot)
            slot.bwd = 0
            slot.bwd_active = False
            slot.want_bwd = False
            slot.want_fwd = False
        keep = []
        for call in self._calls:
            if call.ran or call.dead:
                call.active = False
                for h in call.handles:
                    h.remove()
                call.handles.clear()
            else:
                keep.append(call)
        self._calls = keep
        self._release_pending()
        for slot in self._slots:
            self._maybe_free(slot)

    def _recover(self, prune: bool) -> None:
        """At a forward outside any backward (lock held): a backward that raised never
        ran its end callback, so clean up after it; with ``prune`` (the first layer of a
        forward) also drop the hooks of calls whose graph died without a backward."""
        if self._bwd_running:
            self._cb_queued = False
            self._cleanup_backward()
            if self._worker is not None:
                self._worker.drain()
        if not prune:
            return
        self._out_hooks = {k: v for k, v in self._out_hooks.items() if v[0]() is not None}
        if any(c.dead for c in self._calls):
            keep = []
            for call in self._calls:
                if call.dead:
                    for h in call.handles:
                        h.remove()
                else:
                    keep.append(call)
            self._calls = keep

    def _release_pending(self, keep: int | None = None, only: int | None = None) -> None:
        """Device tensors whose D2H copies are in flight: the stream that allocated them
        waits for the copy, then they are dropped (Note [weight residency], 7). ``keep``:
        not those of this slot; ``only``: only those of this slot."""
        if not self._pending:
            return
        rest = []
        for entry in self._pending:
            sid, event, stream, payload = entry
            if sid == keep or (only is not None and sid != only):
                rest.append(entry)
                continue
            self._backend.wait(stream, event)  # type: ignore[union-attr]
            if callable(payload):
                payload()
        self._pending = rest

    # ---- grads="host" ----------------------------------------------------------------

    def _grad_to_host(self, slot: _Slot, prm: _Param) -> None:
        """Step 7: move ``p.grad`` into the host ``main_grad`` (lock held)."""
        p = prm.param
        grad = p.grad
        if grad is None:
            return
        p.grad = None
        if prm.fused:  # the zero dummy of grad_added_to_main_grad: dW is in the staging
            return
        overwrite = bool(getattr(p, "overwrite_main_grad", False))
        self._to_main_grad(slot, prm, grad, overwrite, None)

    def _to_main_grad(
        self, slot: _Slot, prm: _Param, grad: torch.Tensor, overwrite: bool, after: Any
    ) -> None:
        backend = self._backend
        if not backend.is_async:  # type: ignore[union-attr]
            _accumulate(prm.master, prm.main_grad, grad, overwrite)  # type: ignore[arg-type]
            if after is not None:
                after()
            return
        if not grad.is_contiguous():
            grad = grad.contiguous()
        if self._grad_pool is None:
            self._grad_pool = HostPool(_NO_LIMIT, self.pin_memory)
        block = self._grad_pool.allocate(grad.nbytes)
        if block is None:
            raise RuntimeError(
                f"offload: could not get {grad.nbytes} bytes of host memory to stage a "
                f"gradient of {slot.where}"
            )
        host = block.tensor.view(grad.dtype).view(grad.shape)
        backend.d2h([(grad, host, None)], None)  # type: ignore[union-attr]
        event = backend.record_d2h()  # type: ignore[union-attr]
        stream = backend.current_stream()  # type: ignore[union-attr]
        payload = after if after is not None else _Keep(grad)
        self._pending.append((slot.sid, event, stream, payload))
        job = functools.partial(
            _grad_job, prm.master, prm.main_grad, host, overwrite, self._grad_pool, block
        )
        self._worker.submit(event, job)  # type: ignore[union-attr]

    def _set_staging(self, slot: _Slot, allocate: bool) -> None:
        """Fused weights with grads="host": ``main_grad`` is a device staging buffer while
        the layer runs (memory only during its backward, zeroed there)."""
        for prm in slot.params:
            if prm.staging is None:
                continue
            if allocate and not prm.live:
                self._release_pending(only=slot.sid)  # its last copy must be over
                st = prm.staging.untyped_storage()
                st.resize_(prm.staging.numel() * prm.staging.element_size())
                prm.staging.zero_()
                prm.live = True
            prm.param.main_grad = prm.staging

    def _unset_staging(self, slot: _Slot) -> None:
        for prm in slot.params:
            if prm.staging is not None and not prm.live:
                if getattr(prm.param, "main_grad", None) is prm.staging:
                    del prm.param.main_grad

    def _flush_staging(self, slot: _Slot) -> None:
        """The layer's backward is over: its fused dW goes to the host ``main_grad``."""
        for prm in slot.params:
            if prm.staging is None or not prm.live:
                continue
            prm.live = False
            if getattr(prm.param, "main_grad", None) is prm.staging:
                del prm.param.main_grad
            overwrite = bool(getattr(prm.param, "overwrite_main_grad", False))
            staging = prm.staging
            self._to_main_grad(
                slot, prm, staging, overwrite, functools.partial(_free_storage, staging)
            )

    # ---- state dict ------------------------------------------------------------------

    def _fill_state_dict(self, slot: _Slot, state_dict: Any, prefix: str) -> None:
        """``state_dict()`` post-hook: offloaded parameters as views of their host copies
        (complete even while the device storage is empty)."""
        with self._lock:
            backend = self._backend
            if slot.resident and any(
                prm.param._version != v for prm, v in zip(slot.params, slot.versions)
            ):  # changed on the device (inside resident()): bring the host copy up to date
                for st in slot.stores:
                    backend.d2h([(st.device, st.host, None)], None)  # type: ignore[union-attr]
                slot.write_event = backend.record_d2h()  # type: ignore[union-attr]
                slot.versions = [prm.param._version for prm in slot.params]
            backend.host_wait(slot.write_event)  # type: ignore[union-attr]
            for prm in slot.params:
                view = None
                for name in prm.names:
                    key = prefix + name
                    if key in state_dict:
                        if view is None:
                            view = self._host_view(prm)
                        state_dict[key] = view

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
        if self._closed:
            raise RuntimeError("this WeightOffloader is closed: its parameters are on the device")
        if parameters is None:
            slots = list(self._order)
        else:
            wanted = {id(t) for t in parameters}
            slots = [s for s in self._order if any(id(p.param) in wanted for p in s.params)]
        for s in slots:
            self._hold(s)
        try:
            yield
        finally:
            for s in slots:
                self._unhold(s)

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
        return [prm.master for s in self._order for prm in s.params if prm.master is not None]

    def parameters(self) -> list[nn.Parameter]:
        """Every offloaded parameter, in layer order (once each)."""
        return [prm.param for s in self._order for prm in s.params]

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
        if self._closed:
            raise RuntimeError("this WeightOffloader is closed: push() has nothing to update")
        if self._worker is not None:
            self._worker.drain()
        with self._lock:
            backend = self._backend
            backend.host_wait(self._last_h2d)  # type: ignore[union-attr]
            stream = backend.current_stream()  # type: ignore[union-attr]
            for slot in self._order:
                masters = [prm for prm in slot.params if prm.master is not None]
                if not masters:
                    continue
                backend.host_wait(slot.write_event)  # type: ignore[union-attr]
                slot.write_event = None
                with torch.no_grad():
                    for prm in masters:
                        self._host_view(prm).copy_(prm.master)  # type: ignore[arg-type]
                if slot.resident:  # refresh the device copy too, after its readers
                    pairs = [(st.host, st.device, None) for st in slot.stores]
                    slot.ready = backend.h2d(pairs, [], stream)  # type: ignore[union-attr]
                    if slot.ready is not None:
                        self._last_h2d = slot.ready
                    slot.waited = slot.ready is None
                    slot.stream = stream
                    slot.versions = [prm.param._version for prm in slot.params]

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
        if not isinstance(model, nn.Module):
            raise TypeError(f"check() takes the model (an nn.Module); got {type(model).__name__}")
        inside: set[int] = set()
        for slot in self._order:
            inside.update(id(m) for m in slot.module.modules())
        for name, module in model.named_modules():
            if id(module) in inside:
                continue
            for pname, p in module.named_parameters(recurse=False):
                if p.numel() == 0 or not _packing.is_plain(p):
                    continue
                hit = self._keys.get(p.untyped_storage()._cdata)
                if hit is not None:
                    slot, other = hit
                    full = f"{name}.{pname}" if name else pname
                    raise ValueError(
                        f"parameter {full!r} of the model is also parameter {other!r} of "
                        f"{slot.where}, which is offloaded: outside that layer it has no "
                        f"data on the device. Untie it, or leave that layer out of `layers`"
                    )

    @property
    def bytes_offloaded(self) -> int:
        """Device bytes of the offloaded weights (freed between their uses)."""
        return sum(s.nbytes for s in self._order)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes this offloader holds (weights and gradient staging;
        pinned slabs are powers of two, so this may exceed the weights' bytes)."""
        if not (self.pin_memory and torch.cuda.is_available()):
            return 0
        return sum(p.reserved_bytes for p in (self._pool, self._grad_pool) if p is not None)

    @property
    def host_bytes(self) -> int:
        """Host bytes this offloader holds: weight slabs, gradient staging, and with
        ``grads="host"`` the fp32 masters and ``main_grad``."""
        total = sum(p.reserved_bytes for p in (self._pool, self._grad_pool) if p is not None)
        for s in self._order:
            for prm in s.params:
                for t in (prm.master, prm.main_grad):
                    if t is not None:
                        total += t.nbytes
        return total

    @property
    def resident_layers(self) -> list[int]:
        """Indices (into ``layers``) of the layers whose weights are on the device now."""
        return [s.index for s in self._order if s.resident]

    def close(self) -> None:
        """Put every parameter back on the device and remove every hook. Idempotent; also
        runs when the ``with`` block ends and when the offloader is garbage collected.

        The host copies are freed; with ``grads="host"`` the masters and ``main_grad``
        stay readable through :meth:`host_parameters`.
        """
        if self._closed:
            return
        worker_error = None
        if self._worker is not None:
            try:
                self._worker.drain()
            except RuntimeError as exc:
                worker_error = exc
        with self._lock:
            self._closed = True
            backend = self._backend
            if backend is None:
                return
            stream = backend.current_stream()
            self._release_pending()
            for slot in self._slots:
                for prm in slot.params:
                    if prm.staging is not None:
                        if getattr(prm.param, "main_grad", None) is prm.staging:
                            del prm.param.main_grad
                        prm.staging = None
                if slot.resident:
                    self._wait_ready(slot, stream)
                else:
                    self._make_resident(slot, stream)
                    self._wait_ready(slot, stream)
                for h in slot.hooks:
                    h.remove()
                slot.hooks.clear()
            for call in self._calls:
                for h in call.handles:
                    h.remove()
            self._calls = []
            self._owners = {}
            # The host slabs go now: wait until no copy reads them.
            backend.host_wait(backend.record(stream))
            backend.host_wait(self._last_h2d)
            for slot in self._slots:
                for st in slot.stores:
                    st.block = None
                    st.host = None
        if self._worker is not None:
            self._worker.close()
        for pool in (self._pool, self._grad_pool):
            if pool is not None:
                pool.close()
        self._pool = self._grad_pool = None
        if worker_error is not None:
            raise worker_error

    def __enter__(self) -> WeightOffloader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._order)} layers"
        return (
            f"WeightOffloader({state}, {self.bytes_offloaded} bytes, "
            f"prefetch_layers={self.prefetch_layers}, grads={self.grads!r}, "
            f"pin_memory={self.pin_memory})"
        )

    # ---- manual API: layers found while they run -------------------------------------

    @classmethod
    def _empty(cls, prefetch_layers: int = 1, grads: str = "device", pin_memory: bool = True):
        """An offloader with no layer yet; :meth:`_adopt` adds them."""
        self = cls.__new__(cls)
        self._setup(prefetch_layers, grads, pin_memory)
        return self

    def _adopt(self, module: nn.Module) -> _Slot | None:
        """Offload ``module`` from inside its own first call (called by a global forward
        pre-hook): the weights are copied now and freed at the end of this call."""
        with self._lock:
            plan = self._inspect(len(self._slots), module)
            if plan is None:
                return None
            self._check_shared([plan])
            self._start(plan.device)  # type: ignore[arg-type]
            if self._pool is None:
                self._pool = HostPool(_NO_LIMIT, self.pin_memory, _MAX_SLAB)
            blocks = self._allocate([plan])
            slot = self._install(plan, blocks, running=True)
            n = self.prefetch_layers
            for s in self._sequence[: max(0, len(self._sequence) - n)]:
                if s.want_bwd and not s.bwd_active:  # no longer among the last n
                    s.want_bwd = False
                    self._maybe_free(s)
            return slot


class _Keep:
    """Keeps a device tensor alive until the stream that allocated it waited for the copy
    that reads it (the pending list drops it then)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _covered_bytes(params: list[torch.Tensor]) -> int:
    """Bytes of the storage addressed by ``params`` together (union of their spans)."""
    spans = sorted(_packing.span(p) for p in params)
    total, reach = 0, 0
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _check_layers(layers: Any) -> tuple[list[tuple[int, nn.Module]], list[nn.Module]]:
    """``(first position and module of each distinct module, every module in order)``."""
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"layers must be a sequence of nn.Module (the repeated blocks, e.g. model.layers "
            f"or offload.find_layers(model)); got a single {type(layers).__name__}"
        )
    if not isinstance(layers, (Sequence, nn.ModuleList, nn.Sequential)):
        raise TypeError(f"layers must be a sequence of nn.Module; got {type(layers).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; pass the modules whose weights to offload, in order")
    out: list[tuple[int, nn.Module]] = []
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers[{i}] must be an nn.Module; got {type(layer).__name__}")
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append((i, layer))
    return out, layers


# --------------------------------------------------------------------------------------
# get_cpu_offload_context(..., offload_weights=True)


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
        self._adopted: list[tuple[nn.Module, _Slot]] = []

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

    def _pre(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        off = self.weights
        if self._depth == 1 and id(module) not in off._modules and not off._closed:
            slot = off._adopt(module)
            if slot is not None:
                self._adopted.append((module, slot))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._adopted and self._adopted[-1][0] is module:
            _module, slot = self._adopted.pop()
            off = self.weights
            off._forward_end(slot, args, {}, output)
            off._register_forward(slot.sid)  # its later calls: module hooks

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
