"""Per-layer residency: whether a layer's weights are on the device (the ``Residency``
enum), the refill and free of one layer (``_WeightSlot``), and the holds, prefetches and
counts over all layers of one offloader (``_Layers``; FSDP2's ``_fsdp_param_group``).
Note [weight residency] below says when each weight is on the device and why every wait
is safe."""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload.weights._storage import copy_in, write_back

if TYPE_CHECKING:
    from offload._core._device import Backend
    from offload._core._host_pool import HostPool
    from offload.weights._host_grads import _HostGrads
    from offload.weights._storage import _WeightParam, _WeightStore

# Note [weight residency]
# ~~~~~~~~~~~~~~~~~~~~~~~
# When is a weight on the device, and why is each wait safe? Numbers like 4.1(e) refer to
# the ordering invariants of docs/design.md, section 4.
#
# Each offloaded layer (a *slot*) owns the device storages of its parameters and one host
# copy of each (a block of a HostPool: pinned slabs shared by many weights). The Parameter
# objects never change; only their storage is resized in place (FSDP2's trick), so
# AccumulateGrad nodes, optimizer state keys, weak references of fused layers and saved
# weight.t() views (which share the storage) stay valid. Refills write through a separate
# byte tensor over the storage, so the parameters' version counters do not move.
#
# A slot is resident (Residency FILLING or DEVICE) while anything holds it:
# - fwd: its forward runs (forward pre-hook to forward hook);
# - want_fwd: prefetched for a forward that has not reached it yet (issued at the forward
#   pre-hook of the layer prefetch_layers positions before it);
# - bwd / bwd_active: its backward started (a hook on the gradient of the layer's outputs)
#   and is not over: the gradients of all its inputs that require grad arrived *and* every
#   parameter that gets a .grad ran its post-accumulate-grad hook (either alone when the
#   other does not apply), or the backward ended (a callback queued on autograd's engine);
# - want_bwd: prefetched for a backward (at the backward of the layer prefetch_layers
#   positions after it); or, for the last prefetch_layers layers, kept after a forward whose
#   outputs require grad (their backward comes first);
# - ext: WeightOffloader.resident() and load_state_dict.
# When the last hold goes the slot is freed at once. A forward that raises drops the
# forward prefetches; a backward that raises is cleaned up by the next forward.
#
# Refill (HOST -> FILLING), on the compute stream C (current where the hook runs):
# 1. resize_(nbytes) allocates a block from C's pool of the caching allocator. The block
#    may have been freed a moment ago while kernels that used it are still queued on C:
#    the allocator reuses blocks in stream order, which is safe for later work on C only.
# 2. The H2D stream waits for C (everything queued on C so far) and for the slot's last
#    write-back (step 5: the host bytes must be complete), copies host to device and
#    records the ready event R: it writes the block after every earlier kernel of C that
#    used it (as 4.1(e) for reload buffers).
# 3. (FILLING -> DEVICE) Before the layer's kernels are enqueued (forward pre-hook,
#    backward pre-hook), C waits for R on the device: no kernel reads the weight before the
#    copy wrote it (4.1(c)). The host never waits.
#
# Free (-> HOST), at the forward hook, when the layer's backward is over, or a hold ends:
# 4. If C never waited for R (FILLING: a prefetch that was not used), C waits for it now,
#    so the block cannot be handed to a later kernel of C while the copy still writes it.
# 5. If a parameter's version counter moved since the refill (an optimizer step inside
#    resident(), load_state_dict), the bytes are first copied back to the host on the D2H
#    stream, which waits for C (4.1(a)), and C waits for that copy (4.1(b)).
# 6. resize_(0) on the host thread, after the kernels that read the weight were enqueued
#    on C: the block returns to C's pool, handed only to kernels enqueued later on C,
#    which run after those readers. (When the current stream is not C, C waits for it.)
# Host code that touches a host copy (push(), state_dict()) first waits on the host for
# the last H2D, which may still read it, and the last write-back, which may still write it.
#
# Gradients with grads="host":
# 7. The post-accumulate-grad hook copies p.grad into a pinned staging block on the D2H
#    stream (which waits for C, so after AccumulateGrad wrote it), records event G and sets
#    p.grad = None, but keeps the device tensor: C waits for G and drops it when the next
#    layer's backward is over (or the backward ends), so its block is not reused while the
#    copy reads it (4.1(b)).
# 8. A worker thread waits for G on the host, adds the staging bytes into the fp32
#    main_grad (copies them with overwrite_main_grad) and returns the block to the pool.
#    The end of each backward waits for the worker: main_grad is complete when backward()
#    returns. Fused layers (fuse_wgrad_accumulation=True) write dW into a device staging
#    main_grad (zeroed when the layer's backward starts), which goes the same way.
#
# CPU path: the same logic with SyncBackend: copies happen at once, events are None (a
# refill goes straight to DEVICE), nothing waits, gradients are added directly. It saves
# no memory and exists so every decision runs in CI.


class Residency(enum.Enum):
    """Where a slot's weights are (Note [weight residency])."""

    HOST = "host"  # device storages freed: the host copy is the only one
    FILLING = "filling"  # allocated, refill issued; its stream has not waited for it yet
    DEVICE = "device"  # on the device, ordered before the kernels queued after step 3


class _WeightSlot:
    """One offloaded layer: its storages, parameters, holds and residency (Note [weight
    residency])."""

    def __init__(
        self,
        sid: int,
        index: int,
        module: nn.Module,
        where: str,
        stores: list[_WeightStore],
        params: list[_WeightParam],
    ) -> None:
        self.sid = sid  # position in the offloader's list of slots
        self.index = index  # position of the module in `layers` (first occurrence)
        self.module = module
        self.where = where
        self.stores = stores
        self.params = params
        self.expected: set[int] = set()  # ids of params that get a .grad in backward
        self.state = Residency.DEVICE  # the storages are full until the install frees them
        self.ready: Any = None  # event of the refill's H2D
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
    def resident(self) -> bool:
        return self.state is not Residency.HOST

    @property
    def holds(self) -> int:
        return self.fwd + self.ext + self.bwd + self.want_fwd + self.want_bwd + self.bwd_active

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.stores)

    def changed(self) -> bool:
        """A parameter's version counter moved since the refill (written on the device)."""
        return any(prm.param._version != v for prm, v in zip(self.params, self.versions))

    def load(self, backend: Backend, waits: list, stream: Any) -> Any:
        """Copy the host bytes into the (allocated) storages; returns the ready event."""
        self.ready = copy_in(backend, self.stores, waits, stream)
        self.state = Residency.DEVICE if self.ready is None else Residency.FILLING
        self.stream = stream
        self.versions = [prm.param._version for prm in self.params]
        return self.ready

    def refill(self, backend: Backend, stream: Any) -> Any:
        """Steps 1-2: allocate in ``stream``'s pool and copy in; returns the ready event."""
        for st in self.stores:
            st.storage.resize_(st.nbytes)
        return self.load(
            backend, [self.write_event] if self.write_event is not None else [], stream
        )

    def wait_ready(self, backend: Backend, stream: Any) -> None:
        """Step 3: ``stream`` waits for the refill before the layer's kernels."""
        if self.ready is None:
            return
        if self.state is Residency.FILLING or stream != self.stream:
            backend.wait(stream, self.ready)
            if stream == self.stream:
                self.state = Residency.DEVICE

    def free(self, backend: Backend) -> None:
        """Steps 4-6 (the slot is resident)."""
        stream = self.stream
        if backend.is_async:
            if self.state is Residency.FILLING:
                backend.wait(stream, self.ready)
            current = backend.current_stream()
            if current is not None and stream is not None and current != stream:
                backend.wait(stream, backend.record(current))
        if self.changed():  # write back what changed on the device (step 5)
            event = write_back(backend, self.stores)
            backend.wait(stream, event)
            self.write_event = event
        for st in self.stores:
            st.storage.resize_(0)
        self.state = Residency.HOST
        self.ready = None

    def sync_host(self, backend: Backend) -> None:
        """Bring the host copy up to date (changed on the device inside ``resident()``)
        and wait on the host until no write-back still writes it."""
        if self.resident and self.changed():
            self.write_event = write_back(backend, self.stores)
            self.versions = [prm.param._version for prm in self.params]
        backend.host_wait(self.write_event)


class _Layers:
    """The offloaded layers of one offloader, where their weights are, and what holds
    them: the state its hooks, state-dict hooks and public methods share."""

    def __init__(self, prefetch_layers: int, grads: str, pin_memory: bool) -> None:
        self.prefetch_layers = prefetch_layers
        self.grads = grads
        self.pin_memory = pin_memory
        self.lock = threading.RLock()
        self.closed = False
        self.ref = weakref.ref(self)
        self.slots: list[_WeightSlot] = []
        self.order: list[_WeightSlot] = []  # each slot once, in `layers` order
        self.sequence: list[_WeightSlot] = []  # the calls of a forward: `layers` with repeats
        self.cursor = -1  # position of the latest forward call in `sequence`
        self.modules: dict[int, _WeightSlot] = {}  # id(module) -> slot
        self.keys: dict[int, tuple[_WeightSlot, str]] = {}  # storage key -> (slot, param name)
        self.owners: dict[int, _WeightSlot] = {}  # id(parameter) -> its slot
        self.device: torch.device | None = None
        self.backend: Backend | None = None
        self.pool: HostPool | None = None
        self.host_grads: _HostGrads | None = None  # made with the backend
        self.last_h2d: Any = None
        self.resident_count = 0  # slots resident now
        self.refills = 0
        self.refills_on_demand = 0
        self.max_resident_layers = 0

    def note_h2d(self, ready: Any) -> None:
        if ready is not None:
            self.last_h2d = ready

    def make_resident(self, slot: _WeightSlot, stream: Any) -> None:
        """Refill a slot (steps 1-2); the caller holds the lock."""
        if slot.resident:
            return
        self.note_h2d(slot.refill(self.backend, stream))  # type: ignore[arg-type]
        self.refills += 1
        self.resident_count += 1
        self.max_resident_layers = max(self.max_resident_layers, self.resident_count)

    def wait_ready(self, slot: _WeightSlot, stream: Any) -> None:
        slot.wait_ready(self.backend, stream)  # type: ignore[arg-type]

    def free(self, slot: _WeightSlot) -> None:
        """Steps 4-6; the caller holds the lock."""
        if not slot.resident:
            return
        slot.free(self.backend)  # type: ignore[arg-type]
        self.resident_count -= 1

    def maybe_free(self, slot: _WeightSlot) -> None:
        if slot.resident and slot.holds == 0 and not self.closed:
            self.free(slot)

    def prefetch(self, slots: Iterable[_WeightSlot], stream: Any, backward: bool) -> None:
        for s in slots:
            if backward:
                s.want_bwd = True
            else:
                s.want_fwd = True
            self.make_resident(s, stream)

    def hold(self, slot: _WeightSlot) -> None:
        with self.lock:
            stream = self.backend.current_stream()  # type: ignore[union-attr]
            slot.ext += 1
            self.make_resident(slot, stream)
            self.wait_ready(slot, stream)

    def unhold(self, slot: _WeightSlot) -> None:
        with self.lock:
            slot.ext = max(0, slot.ext - 1)
            self.maybe_free(slot)
