"""The per-forward state machine: which saved tensor goes where, and when.

One :class:`Step` per forward (a context entry holds one or more forwards: a new one
starts when the first layer is called again after a whole forward). It owns the groups
of that forward (one per layer call), their copies and the handles autograd holds.
Handles outlive the context; the step lives as long as any of them.

The package is split along these seams: ``_plan.py`` (which groups, release and reload
points), ``_placement.py`` (keep or copy one tensor, and why), ``_handles.py`` (what
autograd holds), ``_buffers.py`` (reload buffers and double buffering), ``_device.py``
(streams and events), ``_host_pool.py`` (pinned memory) and this module (the life of a
group). Numbers like 4.1(a) refer to the invariants of ``docs/design.md``, section 4.

Note [release order]
~~~~~~~~~~~~~~~~~~~~
This note is the single place that answers "when is this block freed, and why is it
safe?". Code and tests cite it.

Forward, group g (the call of layer g), offloaded:

1. *Pack.* A saved tensor's byte span is copied into a host block at save time (in
   batches of a few tensors, a large one at once, and always before the group closes:
   ``_D2H_BATCH``, ``_D2H_EAGER_BYTES``):
   the D2H stream first waits for the current (compute) stream, so the copy starts
   after the kernel that produced the bytes (4.1(a)), and for the pool's H2D fence, so
   the host block is not overwritten while an earlier backward still reads it (4.1(d)).
   The group keeps ``t.detach()`` (the device reference) and the version at pack time.
   Autograd gets a handle, never the tensor itself (a tensor saved by its own producer
   would otherwise form a cycle through its ``grad_fn``).
1(b). *Gathered copies.* A contiguous tensor that is its whole storage and at most
   ``_GATHER_MAX_BYTES`` joins its group's open bucket of its dtype instead (not with
   compression, in CUDA graph captures or in manual mode): the group keeps
   ``t.detach()`` and its version in the bucket, the handle records its place. The
   bucket's host block is reserved when it opens, grown in place while the bytes after
   it are free, up to ``_GATHER_BUCKET_BYTES``. A bucket is *sealed* when it is full,
   when its group closes, and wherever queued copies are issued for a reason other
   than batching (``finish_forward``, ``start_offload``, a reload): one kernel on the
   current (compute) stream concatenates its members into a flat device tensor, behind
   the kernels that produced them, and that flat tensor is queued for D2H like any
   span. The flat tensor is the one source no group holds: the backend marks it used
   by the D2H stream (``record_stream``) before the scheduler drops it, so the
   allocator hands its block out again only after the copy has read it. The members'
   own tensors are held until the release (step 3), which checks each one's version
   (an in-place change poisons that member alone) and frees the storages only the
   bucket held. The bucket is then one copy for steps 4-7: one reload buffer, one H2D,
   each unpack a view of the buffer at the member's place, and its host block returns
   when the last member's handle dies. Why: below about a MiB the host time of a copy
   of its own (allocating the block, issuing the copy, reloading it) exceeds the
   link's time, and small layers are paced by it.
1(c). *The step's first layer call.* When group 0 (the forward's first layer call) is
   offloaded, its saves are placed at its close instead of at save time (not in
   captures, manual mode or measuring forwards). Why: the step starts with nothing
   queued on the device (training loops often synchronise between steps), so every
   microsecond the host spends in that call, placing a save and issuing its copy (50-150
   us for a large tensor on an H200's host), is a microsecond the device waits; from the
   second call on the host is ahead and the same work is hidden. At save time the handle
   is a ``Pending`` around a ``Kept`` (what an unpack before the close gets), and a save
   of at least ``_D2H_EAGER_BYTES`` takes a mark of the current stream
   (``Backend.mark_ready``, an event). At the close, or earlier where the group's copies
   are issued with its buckets sealed (``_flush_d2h``: the end of the forward,
   ``start_offload``), each save is placed in order as in steps 1 and 1(b), with its
   version at save time (a change in place in between poisons it at the release, step
   3), and a copy issued while placing it waits for its save's mark instead of a mark
   taken now: a large tensor's copy still starts once its producer is done, smaller ones
   wait for the next mark (or one taken at the close), and a bucket's flat copy always
   for a mark taken after the kernel that wrote it. Nothing is released before the
   close, so holding the tensors until then costs no memory.
2. *Close.* When the layer's forward ends, an event is recorded on the D2H stream: it
   completes when every copy of the group (and of earlier groups) has landed.
3. *Release.* At the start of layer ``r = max(g + 1, L - k + j)`` (g is the j-th of the
   k offloaded groups; at the end of the forward when ``r == L``), the compute stream
   waits for that event (``wait_event``: the device waits, the host does not) and the
   group drops its device references. From then on the caching allocator may hand the
   blocks to later kernels of the compute stream, which are queued behind the wait, so
   no kernel can overwrite a block before its copy has read it (4.1(b)). The version
   recorded at pack is compared first: a mismatch poisons the copy, and its unpack
   raises the "modified by an inplace operation" error (4.6). A change made after the
   release cannot be seen.

Backward (outside the context, possibly on autograd's device threads):

4. *Reload.* When the backward of layer ``q`` starts (the first gradient of its outputs
   arrives: ``register_multi_grad_hook(mode="any")``), the groups due at ``q`` are
   reloaded: buffers are allocated *in the compute stream's pool*; the H2D stream waits
   for the compute stream (the new blocks may have been freed there by queued kernels,
   4.1(e)) and for the D2H event of the group that made each copy, copies, and records
   a reload event. That event becomes the pool's H2D fence (step 1).
5. *Unpack.* The first unpack of a copy makes the group's compute stream (where its
   backward runs: autograd runs a node's backward on its forward's stream) wait for
   its reload event (4.1(c)), once for every copy of that event, and rebuilds the
   tensor as a view of the reloaded span. A copy that
   was not reloaded (irregular graphs, manual schedules) is reloaded on demand here.
6. *Drop.* A group gives up its reloaded buffers when the gradients of its inputs are
   complete (a tensor hook on each layer input that requires grad), or when its
   last handle dies (autograd frees saved variables as nodes finish). A buffer whose
   reload event no stream has waited for is first waited for on the compute stream, so
   its block returns to the allocator only after the H2D that writes it (4.1(e)).
   A copy shared by several groups keeps its buffer until all of them dropped it.
7. *Death.* When the last handle of a copy dies, its host block returns to the pool.
   The next D2H into that block waits for the pool's H2D fence (step 1). A handle can die
   on any thread: if the lock is busy, the work is queued and done by the next caller.

*Compressed copies* (``compress="fp8"``, ``_device.CudaBackend``) add two kernels and
change no step above. In step 1 a high-priority codec stream waits for the compute
stream like the D2H stream does, quantizes the span into a staging slot, and the D2H
stream copies the slot after waiting for that kernel: the group's D2H event still
completes after every read of the device bytes. In step 4 the H2D stream copies the
packed host bytes into a staging slot and the codec stream, behind that copy (and so
behind the compute stream and the D2H events the H2D stream waited for), dequantizes
the slot into the reload buffer; the reload event is recorded on the codec stream after
it waited for the H2D stream, so it covers both. A slot is rewritten only after the
event that follows its last reader (``_Staging.write``); the slots' events are recorded
again at every use, which is safe because a wait already queued refers to the record
made before it (``_Staging``).

8. *Hooks.* The tensor hooks of steps 4 and 6 are removed when the step's backward is
   over (every group with copies dropped; queued to the end of that backward with
   autograd's ``queue_callback``), or at the next forward for a step whose graph died
   without a backward. Nothing of a step outlives that but its stats.

*Manual mode* (``get_cpu_offload_context(manual_synchronization=True)``,
``Step.manual``) changes who triggers the steps, not what each one waits for. Step 1 is
deferred: a save is held on the device (``Held``, a weak entry in ``_Group.held``) until
the caller's ``start_offload_layer`` for that layer and forward, which places it then
and issues its copy behind the work queued so far on the stream the layer ran on
(4.1(a) holds: the producing kernels are queued before the call) and records the group's
D2H event (step 2). Step 3 runs only on ``release_activation_forward_gpu_memory``, never on a schedule
and never at the end of the forward; it is the same ``_release``, so the compute stream
waits for that event before any device reference is dropped (4.1(b)). Step 4 runs on
``start_reload_layer`` (the same ``_reload``), or on demand at the first unpack (step
5) when the caller skipped it. A started group whose handles all die unreleased is
released then (``_retire``), after the same wait. The synchronizer checks the order per
layer (start, release, reload; once each) and raises otherwise; several forwards can be
in flight, each with its own groups.

*CUDA graphs* (``Step.capture``) change where the steps above are recorded, not what
they wait for. A captured step records its copies, events and waits into the graph:
every wait on an event becomes a graph edge, so each replay re-runs steps 1-5 in the
order captured, and nothing of ours runs in Python on replay. Three things differ:

- The host blocks a captured copy wrote are *bound to the graph*: every replay writes
  and reads the same host addresses, so at step 7 a captured copy's block is not
  returned to the pool but kept (``Runtime.graph_blocks``), with its slab, until
  ``free_graph_memory()`` or until the offloader itself is deleted (``close()`` keeps
  them: a graph may still be replayed). The pool's bytes stay flat across replays
  because replays allocate nothing.
- No captured D2H waits for the pool's H2D fence (step 1) and no captured reload
  becomes the fence: a wait inside a capture on an event recorded outside it is not
  allowed, and no other copy ever reuses a graph-bound block, which is all the fence
  protects. (A capture starts after a device synchronisation, so no eager H2D is in
  flight then.)
- Every stream a capture forks must rejoin the capturing stream before the capture
  ends. In a whole-step capture (``capture == "step"``: the context was entered while
  capturing, e.g. inside ``torch.cuda.graph``) the joins are the waits of steps 3 and
  5, as eagerly: the release of the last offloaded group at the end of the forward
  and the unpack of each reload. In a per-layer capture (``capture == "layer"``,
  ``offload.make_graphed_callables``) each layer call is its own graph, so its group
  is released at its own close (the compute stream waits for its D2H there) and
  reloaded by its own backward, whose H2D needs no wait for a D2H event (the forward
  graph ended after its copies, and its events cannot be waited for in another
  graph): nothing crosses from one graph into another, and the copies overlap only
  the rest of their own layer.

An exception inside the forward (``Step.abort``) waits for the outstanding D2H copies on
the compute stream, drops every device reference and returns every host block at once;
the failed forward's graph can no longer be unpacked.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors
from torch.multiprocessing.reductions import StorageWeakRef

from offload import _compress, _device, _packing, _placement, _timing
from offload._buffers import ReloadBuffers, _storage_use_count
from offload._device import Backend, backend_for
from offload._handles import (
    Gathered,
    Held,
    Kept,
    Offloaded,
    PackedQuantized,
    PackedSubclass,
    Pending,
    Raw,
    inplace_message,
)
from offload._host_pool import HostBlock, HostPool
from offload._plan import Schedule
from offload._warn import warn_at_caller
from offload.profiling import KEEP_REASONS, LayerStats, OffloadStats

__all__ = ["Runtime", "Step", "in_backward", "opted_out"]


class _ThreadState(threading.local):
    #: depth of offload.no_offload() on this thread (a class default: a missing
    #: attribute of a threading.local costs an exception on every lookup)
    no_offload = 0


_thread = _ThreadState()


def opted_out() -> bool:
    """Whether the calling thread is inside :func:`offload.no_offload`."""
    return _thread.no_offload > 0


def in_backward() -> bool:
    """Whether the calling thread runs inside autograd's engine (a backward)."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1


def _enter_no_offload() -> None:
    _thread.no_offload += 1


def _exit_no_offload() -> None:
    _thread.no_offload -= 1


_nbytes = _placement.kept_bytes

#: D2H copies issued together (Note [release order], 1): one wait on the compute stream
#: and one stream switch per batch instead of per saved tensor; a batch is also issued
#: when its group closes, so no copy waits longer than its layer.
_D2H_BATCH = 8
#: ... except that a span of at least this many bytes is issued at once (with what is
#: queued before it): batching saves host time per small copy, while a large copy that
#: waited for the rest of its batch (or for its group to close, when the layer saves
#: few tensors: the matmul outputs of a ``selective_offload`` layer) starts late and
#: leaves the link idle meanwhile.
_D2H_EAGER_BYTES = 16 << 20
#: Gathered copies (Note [release order], 1(b)): a contiguous tensor that fills its own
#: storage and has at most this many bytes joins its layer call's bucket of its dtype
#: instead of getting a host block and a copy each way of its own. Below about a MiB a
#: tensor's link time (19 us at 55 GB/s) is no more than the host time of a copy of its
#: own (allocating, issuing and later reloading it), which then paces small layers.
_GATHER_MAX_BYTES = 1 << 20
#: ... and a bucket holds at most this many bytes (the flat device copy that carries it
#: exists from its seal until its D2H copy has read it). Its host block is reserved at
#: ``_GATHER_FIRST_BYTES`` (or its first member's size) when it opens, doubled in place
#: while the bytes after it are free, and trimmed to what it used when sealed.
_GATHER_BUCKET_BYTES = 8 << 20
_GATHER_FIRST_BYTES = 256 << 10


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # _dtype_name, cached (Step._count_sent)


_tensors_in = _packing.tensors_requiring_grad


def _base_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte span of ``t``'s base when ``offload.start_offload(...,
    offload_base_tensor=True)`` marked the view ``t`` (TransformerEngine's attribute)."""
    d = t.__dict__
    if d and d.get("offload_base_tensor"):
        base = t._base
        if base is not None:
            return _packing.span(base)
    return None


def _remove_all(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()


# --------------------------------------------------------------------------------------
# copies and groups


class _Copy:
    """One span of one device storage, copied to the host once per forward.

    ``owner`` is the index of the group whose D2H event covers the copy (an index, not
    the group: a group lists its copies, and a back reference would be a cycle that
    only the garbage collector frees, with the device buffers it holds)."""

    __slots__ = (
        "owner",
        "start",
        "end",
        "version",
        "host",
        "refs",
        "buffer",
        "reload_event",
        "stream",
        "waited",
        "holders",
        "users",
        "poison",
        "ref",
        "storage_nbytes",
        "codec",
        "spec",
        "host_view",
    )

    def __init__(
        self,
        owner: int,
        start: int,
        end: int,
        version: int,
        host: HostBlock,
        codec: torch.dtype | None,
        storage: torch.UntypedStorage | None,
        storage_nbytes: int,
    ):
        self.owner = owner
        self.start = start
        self.end = end
        self.version = version
        self.host: HostBlock | None = host
        self.refs = 0  # live handles
        self.buffer: torch.Tensor | None = None  # reloaded device bytes
        self.reload_event: Any = None
        self.stream: Any = None
        self.waited = False
        self.holders = 0  # groups that have not yet dropped the reloaded buffer
        self.users = 0  # groups whose handles point at this copy
        self.poison: str | None = None
        #: the device storage, while it lives (None for a bucket: its members have theirs)
        self.ref = None if storage is None else StorageWeakRef(storage)
        self.storage_nbytes = storage_nbytes
        #: compress="fp8": the dtype the span is quantized from (its host bytes are the
        #: packed form of offload/_compress.py); None: the span's bytes, exactly
        self.codec = codec
        #: (dtype, size, stride) when the span is the whole storage of a contiguous
        #: tensor of that geometry (the common case): its host bytes are written and read
        #: through ``host_view`` (that geometry over the host block) and it is reloaded
        #: into a buffer of that geometry, which its handles of that geometry return as
        #: they are (no byte views). None: byte copies (uint8 host view and buffers).
        self.spec: tuple[torch.dtype, torch.Size, tuple[int, ...]] | None = None
        #: the host block as the copies write and read it: ``spec``'s geometry, else its
        #: ``length`` bytes (``uint8``); a view the pool caches (``HostBlock.typed``).
        #: None once the block is returned.
        self.host_view: torch.Tensor | None = None


class _Bucket(_Copy):
    """The small tensors of one layer call and one dtype that travel together (Note
    [release order], 1(b)): one host block, one D2H and one H2D copy. Its members are
    numbered in saving order; ``Step.storages`` lists ``(bucket, i)`` under member
    ``i``'s device storage, so that saving that storage again finds it.

    Until its seal the bucket's span ``[0, end)`` counts the elements it can hold; then
    ``end`` is its bytes and ``spec`` its flat geometry, like any copy's."""

    __slots__ = (
        "dtype",
        "fill",
        "sources",
        "versions",
        "offsets",
        "poisons",
        "watched",
    )

    def __init__(self, owner: int, capacity: int, host: HostBlock, dtype: torch.dtype):
        super().__init__(owner, 0, capacity, -1, host, None, None, 0)
        self.dtype = dtype
        self.fill = 0  # elements used
        #: the members' device tensors, until the group's release (the device reference)
        self.sources: list[torch.Tensor] | None = []
        #: each member's version at pack; -1 once the release freed its storage
        self.versions: list[int] = []
        self.offsets: list[int] = []  # each member's first element
        #: member -> the in-place error found at the release
        self.poisons: dict[int, str] | None = None
        #: member -> its storage, for members whose storage outlives the release
        self.watched: dict[int, StorageWeakRef] | None = None


class _Group:
    """One layer call of a forward."""

    __slots__ = (
        "index",
        "module",
        "offload",
        "stream",
        "copies",
        "device_refs",
        "d2h_done",
        "released",
        "reloaded",
        "dropped",
        "live",
        "stats",
        "state",
        "closed",
        "inputs_expected",
        "inputs_seen",
        "times",
        "held",
        "phase",
        "deferred",
    )

    def __init__(self, index: int, module: torch.nn.Module | None, offload: bool, stream: Any):
        self.index = index
        self.module = module
        self.offload = offload
        self.stream = stream  # the compute stream current when the layer ran
        self.copies: dict[int, _Copy] = {}  # id -> copy, also copies made by other groups
        #: (device tensor, version at pack, its copy); (None, -1, bucket) for a bucket,
        #: whose members' tensors the bucket holds
        self.device_refs: list[tuple[torch.Tensor | None, int, _Copy]] = []
        self.d2h_done: Any = None
        self.released = False
        self.reloaded = False
        self.dropped = False  # its backward ended at least once
        self.live = 0  # live handles pointing at copies
        self.stats = LayerStats(index=index, offloaded=offload)
        self.state: _placement.LayerState | None = None
        self.closed = False
        self.inputs_expected = 0
        self.inputs_seen = 0
        #: timing records (timing=True, or a measuring forward's: offload/_auto_probe.py)
        self.times: list[tuple[Any, ...]] | None = None
        #: manual mode: saves waiting for start_offload_layer: (weakref to the Held
        #: handle, span start, span end, base span or None, bytes counted not_selected)
        self.held: list[tuple[Any, int, int, tuple[int, int] | None, int]] = []
        #: manual mode: "saved", "offload_started", "released", "reload_started"
        self.phase = "saved"
        #: the step's first layer call: saves placed at its close (Note [release
        #: order], 1(c)): (handle, tensor, ready mark or None); None: placed at save
        self.deferred: list[tuple[Pending, torch.Tensor, Any]] | None = None


# --------------------------------------------------------------------------------------
# the runtime shared by the forwards of one offloader


class Runtime:
    """State shared by every forward of one offloader: config, pool, backends, lock."""

    def __init__(
        self, config: Any, *, offload_stream: Any = None, retain_host: bool = False
    ) -> None:
        self.config = config
        #: get_cpu_offload_context(offload_stream=...): the CUDA stream of every copy
        self.offload_stream = offload_stream
        #: host blocks bound to captured CUDA graphs (Note [release order], "CUDA
        #: graphs"): never returned to the pool, since replays write them; released by
        #: free_graph_memory() (close() keeps them)
        self.graph_blocks: list[HostBlock] = []
        #: get_cpu_offload_context(retain_pinned_cpu_buffers=True): slabs are kept
        self.retain_host = retain_host
        self.lock = threading.Lock()
        self._pool: HostPool | None = None
        self._backends: dict[torch.device, Backend] = {}
        self.graveyard: collections.deque[tuple[Step, _Copy, _Group | None]] = collections.deque()
        self.warned_host_limit = False

    @functools.cached_property
    def pool(self) -> HostPool:
        """The host pool, made at first use (``_pool`` stays ``None`` until then); a
        cached property: read for every offloaded tensor, it costs an attribute lookup
        once made."""
        self._pool = HostPool(
            self.config.host_memory_limit, self.config.pin_memory, retain=self.retain_host
        )
        return self._pool

    def backend(self, device: torch.device) -> Backend:
        b = self._backends.get(device)
        if b is None:
            b = self._backends[device] = backend_for(device, self.offload_stream)
        return b

    def drain(self) -> None:
        """Finish the work of handles that died while the lock was busy (lock held)."""
        while self.graveyard:
            step, copy, group = self.graveyard.popleft()
            step._retire(copy, group)

    def close(self) -> None:
        """Give the pool's slabs back, except those of graph-bound blocks (each block
        keeps its slab alive): a captured graph may still be replayed."""
        with self.lock:
            self.drain()
            if self._pool is not None:
                self._pool.close()  # the pool can grow again if the offloader is reused

    def free_graph_memory(self) -> int:
        """Forget the host blocks bound to captured graphs; returns their bytes."""
        with self.lock:
            freed = 0
            for block in self.graph_blocks:
                if block.slab is not None:
                    freed += block.nbytes
                    self.pool.free(block)
            self.graph_blocks.clear()
            return freed


# --------------------------------------------------------------------------------------
# one forward


class Step:
    """The groups, copies and stats of one forward, and the hooks that drive them.

    Lifetime: the offloader keeps the most recent Step (for its stats) and any Step whose
    backward has not run yet; autograd's handles keep theirs. Nothing else does: every
    hook a Step registers on a tensor is removed when its backward is over (or when the
    next forward starts), and no object of a Step points back at one that points at it.
    """

    def __init__(self, runtime: Runtime, plan: Schedule) -> None:
        self.rt = runtime
        self.cfg = runtime.config
        self.plan = plan
        self.groups: list[_Group] = []
        self.open: _Group | None = None
        self.depth = 0  # nested calls of registered layers inside an open group
        self.pending: list[tuple[Pending, torch.Tensor]] = []
        self.forward_done = False
        self.aborted = False
        self.backward_done = False
        self.storages: dict[int, list[_Copy | tuple[_Bucket, int]]] = {}
        #: dtype -> the bucket of the open group being filled (Note [release order],
        #: 1(b)); every bucket of the step, for abort()
        self.buckets: dict[torch.dtype, _Bucket] = {}
        self.all_buckets: list[_Bucket] = []
        self.stats = OffloadStats()
        self.outside = dict.fromkeys(KEEP_REASONS, 0)  # kept bytes saved outside groups
        self.device: torch.device | None = None
        self.backend: Backend | None = None
        self.hooks: list[Any] = []
        self.awaiting = 0  # groups with copies whose backward has not ended yet
        self.buffers = ReloadBuffers(self.cfg.double_buffering)
        #: a measuring forward of offload_layers="auto": every group keeps the saved-
        #: tensor hooks, and those not offloaded count the bytes they would send
        self.probe = False
        #: offload_layers="auto"'s observer of this forward (offload/_auto_probe.py):
        #: told when a group opens and closes, and (measuring) of each candidate save
        self.watch: Any = None
        #: D2H copies not issued yet (Note [release order], 1): issued in small batches
        #: (one stream switch and one wait per batch) and always before a group closes
        self.d2h_queue: list[tuple[torch.Tensor, torch.Tensor, torch.dtype | None]] = []
        #: sources in the queue that nothing else holds (sealed buckets' flat copies):
        #: the backend keeps each until its copy has read it
        self.d2h_transient: list[torch.Tensor] = []
        self.compress = self.cfg.compress is not None
        #: the config's, read for every saved tensor (the config is frozen)
        self.tensor_filter = self.cfg.tensor_filter
        self.min_tensor_bytes = self.cfg.min_tensor_bytes
        #: get_cpu_offload_context(manual_synchronization=True): saves are held until
        #: start_offload_layer, and nothing is released or reloaded on a schedule
        #: (Note [release order], "Manual mode")
        self.manual = False
        #: None (eager), "step" (the whole forward and backward are captured in one CUDA
        #: graph) or "layer" (each layer call is its own graph): Note [release order],
        #: "CUDA graphs"
        self.capture: str | None = None
        #: small tensors travel in buckets (Note [release order], 1(b)): not with
        #: compression, in captures or in manual mode (set when a group opens)
        self.gathering = False
        #: while deferred saves are placed (1(c)): the mark after the one being placed
        #: was produced, for the D2H copies issued then (None: mark now)
        self.d2h_ready: Any = None

    @property
    def stats_double_buffer_reuses(self) -> int:
        return self.buffers.reuses

    @property
    def spares(self) -> dict[int, list[torch.Tensor]]:
        return self.buffers.spares

    # ---- forward: layer boundaries ----------------------------------------------------

    def open_group(self, module: torch.nn.Module | None, inputs: Any = None) -> None:
        with self.rt.lock:
            self.rt.drain()
            if self.open is not None:  # a registered layer called inside another one
                self.depth += 1
                return
            index = len(self.groups)
            if self.capture is None and _device.capturing():
                raise RuntimeError(
                    "offload: a CUDA graph capture began after the offloader was entered, "
                    "so the offloader cannot tell which of its copies belong to the graph. "
                    "Enter the offloader inside the capture (with torch.cuda.graph(g): with "
                    "offloader: ...), or graph single layers with "
                    "offload.make_graphed_callables."
                )
            if self.capture is not None:
                self._check_capturable()
            if index < self.plan.num_groups:
                offload = index in self.plan.offloaded
            else:
                offload = bool(self.plan.select(index, module))
            stream = self.backend.current_stream() if self.backend is not None else None
            self.gathering = not (self.compress or self.capture or self.manual)
            group = _Group(index, module, offload, stream)
            if offload and index == 0 and not (self.capture or self.manual or self.probe):
                group.deferred = []  # Note [release order], 1(c)
            if self.cfg.timing:
                group.times = []
            self.groups.append(group)
            self.stats.layers.append(group.stats)
            self.open = group
            for j in self.plan.release_at.get(index, ()):
                if j < index:
                    self._release(self.groups[j])
            pending, self.pending = self.pending, []
            for handle, t in pending:
                if offload or self.probe:
                    handle.inner = self._place(t, group)
                else:
                    group.stats.bytes_kept["not_selected"] += _nbytes(t)
        if self.watch is not None:
            self.watch.opened(self, group, inputs)
        if offload and inputs is not None:
            tensors = _tensors_in(inputs, [])
            group.inputs_expected = len(tensors)
            # Plain tensor hooks, not register_multi_grad_hook(mode="all"): that one keeps
            # the inputs' grad_fns in its closure, which the hook registered on those very
            # nodes turns into a reference cycle that keeps the whole graph alive.
            hook = functools.partial(self._input_grad, index)
            for t in tensors:
                self.hooks.append(t.register_hook(hook))

    def close_group(self, outputs: Any = None) -> None:
        with self.rt.lock:
            if self.depth:
                self.depth -= 1
                return
            group = self.open
            if group is None:
                return
            self.open = None
            group.closed = True
            self._flush_d2h(group)
            if group.device_refs and self.backend is not None:
                group.d2h_done = self.backend.record_d2h()
            if self.capture == "layer":
                # this layer's graph ends with the layer: join its D2H now (Note
                # [release order], "CUDA graphs")
                self._release(group)
            index = group.index
        if self.watch is not None:
            self.watch.closed(self, group, outputs)
        if outputs is not None:
            self.register_trigger(index, outputs)

    def register_trigger(self, index: int, outputs: Any) -> None:
        """Reload the groups due at ``index`` when the gradient of ``outputs`` arrives."""
        if index not in self.plan.reload_at:
            return
        tensors = _tensors_in(outputs, [])
        fn = functools.partial(self._backward_started, index)
        if len(tensors) == 1:
            # One output (the usual case): a plain tensor hook fires when its gradient
            # arrives, as register_multi_grad_hook(mode="any") would, at a fraction of
            # the cost.
            self.hooks.append(tensors[0].register_hook(fn))
        elif tensors:
            self.hooks.append(
                torch.autograd.graph.register_multi_grad_hook(tensors, fn, mode="any")
            )

    def finish_forward(self) -> None:
        """The forward ended normally: release what is left (Note [release order], 3)."""
        with self.rt.lock:
            self.rt.drain()
            self._flush_d2h(self.open)
            self.open = None
            self.forward_done = True
            for _handle, t in self.pending:
                self.outside["outside_layers"] += _nbytes(t)
            self.pending = []
            for group in self.groups:
                if group.offload and not group.released and not self.manual:
                    if not group.closed and group.device_refs and self.backend is not None:
                        group.d2h_done = self.backend.record_d2h()
                    self._release(group)
            self.awaiting = sum(1 for g in self.groups if g.copies)
        if not self.awaiting and not self.probe:
            self.backward_done = True  # nothing to reload: no hook is needed
            self.remove_hooks()

    def abort(self) -> None:
        """The forward raised: free everything now (Note [release order], last part)."""
        with self.rt.lock:
            self.rt.drain()
            self.open = None
            self.forward_done = True
            self.aborted = True
            self.backward_done = True
            self.pending = []
            for group in self.groups:
                group.deferred = None  # their handles keep the tensors (Kept)
            self.d2h_queue = []  # never issued: their host blocks are freed below
            self.d2h_transient = []
            self.buckets = {}
            if self.backend is not None and any(g.device_refs for g in self.groups):
                done = self.backend.record_d2h()
                for group in self.groups:
                    if group.device_refs:
                        self.backend.wait(group.stream, done)
            for group in self.groups:
                group.device_refs.clear()
                group.released = True
            for copies in [*self.storages.values(), self.all_buckets]:
                for copy in copies:
                    if type(copy) is tuple:
                        continue  # a bucket's member: the bucket is in all_buckets
                    if copy.host is not None:
                        self.rt.pool.free(copy.host)
                        copy.host = None
                        copy.host_view = None
                    copy.buffer = None
                    if type(copy) is _Bucket:
                        copy.sources = None
            self.storages.clear()
            self.all_buckets.clear()
            self.buffers.clear()
        self.remove_hooks()

    def _check_capturable(self) -> None:
        """Raise for settings a captured step cannot honour (lock held)."""
        if self.cfg.timing:
            raise RuntimeError(
                "offload: timing=True reads CUDA event times, which a CUDA graph capture "
                "does not allow; pass timing=False to the offloader used in the capture"
            )
        if self.probe:
            raise RuntimeError(
                "offload: offload_layers='auto' measures the first forward of each kind "
                "of input, and a CUDA graph capture cannot be measured; run two eager steps "
                "with the capture's shapes first (the usual warm-up), or pass an explicit "
                "offload_layers"
            )
        if self.compress:
            raise NotImplementedError(
                "offload: compress='fp8' is not supported inside CUDA graph captures yet; "
                "pass compress=None to the offloader used in the capture"
            )

    def remove_hooks(self) -> None:
        """Remove every hook this step registered on tensors (idempotent)."""
        _remove_all(self.hooks)

    @property
    def finished(self) -> bool:
        """Its backward ended, or its graph is gone: its hooks are of no more use."""
        return self.backward_done or not any(g.live for g in self.groups)

    # ---- forward: packing ------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        """The pack half of the saved-tensor hooks (Note [release order], 1).

        Hot path: it runs for every saved tensor. Tensors saved outside any group or in
        a group that is not offloaded are kept at once, without taking the lock (only
        the forward's thread touches those counters).
        """
        group = self.open
        if group is None:
            if not self.groups or self.forward_done:
                self.outside["outside_layers"] += _nbytes(t)
                return Kept(t)
        elif not group.offload and not self.probe:
            group.stats.bytes_kept["not_selected"] += _nbytes(t)
            return Kept(t)
        with self.rt.lock:
            return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Any:
        group = self.open
        d = t.__dict__
        if _thread.no_offload > 0 or (  # opted_out(), _placement.marked(t)
            d and (d.get("_TE_do_not_offload") or d.get("_do_not_offload"))
        ):
            return self._keep("opted_out", group, t)
        cls = type(t)
        if (cls is not torch.Tensor and issubclass(cls, torch.nn.Parameter)) or (
            d and d.get("is_weight", False)
        ):
            return self._keep("parameter" if group is not None else "outside_layers", group, t)
        if cls is not torch.Tensor:  # _packing.is_plain(t): Parameters returned above
            if _packing.is_te_quantized(t):
                # TransformerEngine >= 2.0 quantized tensor: prepare_for_saving() empties
                # the object it is called on, so call it on a detached alias, never on
                # the hook's input (the hook must not modify it).
                tensors, obj = t.detach().prepare_for_saving()
                parts = [None if x is None else self._pack(x) for x in tensors]
                return PackedQuantized(obj, parts)
            flat = _packing.flatten(t)
            if flat is not None:
                names, ctx, inner = flat
                # inner entries that are not tensors (DTensor's mesh) are kept as they are
                parts = [self._pack(x) if isinstance(x, torch.Tensor) else Raw(x) for x in inner]
                return PackedSubclass(type(t), names, ctx, parts, t.size(), t.stride())
            return self._keep("unsupported", group, t)
        # _packing.unsupported(t), inlined
        if t.layout != torch.strided or t.is_nested or t.is_quantized or t.is_meta:
            return self._keep("unsupported", group, t)
        if group is None:
            if self.groups and not self.forward_done:
                handle = Pending(Kept(t))
                self.pending.append((handle, t))  # decided when the next group opens
                return handle
            return self._keep("outside_layers", None, t)
        deferred = group.deferred
        if deferred is not None:  # the step's first layer call (1(c))
            handle = Pending(Kept(t))
            ready = None
            if t.is_cuda and t.numel() * t.element_size() >= _D2H_EAGER_BYTES:
                ready = self.rt.backend(t.device).mark_ready()
            deferred.append((handle, t, ready))
            return handle
        return self._place(t, group)

    def _place_deferred(self, group: _Group) -> None:
        """Place the saves of ``group`` held back at save time (Note [release order],
        1(c); lock held). Each is placed as it would have been then: with its version
        at save time, and its copy ordered after the mark taken then."""
        items, group.deferred = group.deferred, None
        try:
            for handle, t, ready in items:  # type: ignore[union-attr]
                version = handle.inner.version  # type: ignore[union-attr]
                self.d2h_ready = ready
                inner = self._place(t, group, version)
                if type(inner) is Kept:
                    inner.version = version
                handle.inner = inner
        finally:
            self.d2h_ready = None

    def _keep(self, reason: str, group: _Group | None, t: torch.Tensor) -> Kept:
        """Keep ``t`` on the device, counted under ``reason``."""
        kept = group.stats.bytes_kept if group is not None else self.outside
        kept[reason] += _nbytes(t)
        return Kept(t)

    def _place(
        self, t: torch.Tensor, group: _Group, version: int | None = None
    ) -> Kept | Offloaded:
        """Keep ``t`` on the device with a reason, or start its copy to the host.
        ``version``: ``t``'s version when it was saved (default: now).

        Hot path (Note [release order], 1): every check below runs for every tensor, in
        this order; what is computed once (the storage, the span) is reused."""
        device = t.device
        if device != self.device:
            if t.dim() == 0 or t.numel() == 0:
                # a scalar or an empty tensor (attention's RNG state, a CPU scalar beside
                # CUDA activations) neither travels nor chooses the step's device
                return self._keep("small", group, t)
            if device.type in ("cpu", "cuda") and (
                self.device is None
                # a CPU tensor seen first gives way to the accelerator while nothing
                # has been copied
                or (self.device.type == "cpu" and device.type == "cuda" and not self.storages)
            ):
                self.device = device
                self.backend = self.rt.backend(device)
                group.stream = self.backend.current_stream()
            else:
                return self._keep("device", group, t)
        state = group.state
        if state is None:
            state = group.state = _placement.layer_state(group.module)
        storage = t.untyped_storage()
        # _placement.parameter_like, inlined (_pack kept the Parameters already)
        storages, frozen = state.storages, state.frozen_shapes
        fn = t.grad_fn
        if (
            storage.data_ptr() in storages
            or (fn is not None and _packing.derives_from_parameter(fn, storages))
            or (fn is None and frozen and not t.requires_grad and tuple(t.shape) in frozen)
        ):
            return self._keep("parameter", group, t)
        flt = self.tensor_filter
        if flt is not None and not flt(t):
            return self._keep("filtered", group, t)
        contiguous = t.is_contiguous()
        if contiguous:  # _packing.span, inlined for the common case
            start = t.storage_offset() * t.element_size()
            end = start + t.nbytes
        else:
            start, end = _packing.span(t)
        nbytes = end - start
        if nbytes < self.min_tensor_bytes or nbytes == 0:
            return self._keep("small", group, t)
        if not group.offload:  # a measuring forward: count what would travel
            total = storage.nbytes()
            size = total if 2 * nbytes >= total else nbytes
            if self.compress and self._codec(t, 0, size) is not None:
                size = _compress.packed_nbytes(size // t.element_size())
            if self.watch is not None:
                self.watch.count(group.index, storage._cdata, size)
            return self._keep("not_selected", group, t)
        if self.manual and group.phase == "saved":
            # the held alias will have no _base: take the base's span now
            return self._hold(t, group, start, end, _base_span(t))
        return self._copy(t, group, storage, start, end, None, contiguous, version)

    def _copy(
        self,
        t: torch.Tensor,
        group: _Group,
        storage: Any,
        start: int,
        end: int,
        wide: tuple[int, int] | None,
        contiguous: bool = False,
        version: int | None = None,
    ) -> Kept | Offloaded:
        """Start the copy of bytes ``[start, end)`` of ``t``'s storage (or find the copy
        that already holds them) and return its handle (lock held). ``wide``: the span of
        the base of a view marked ``offload_base_tensor`` (``None``: looked up on ``t``).
        ``contiguous``: ``t.is_contiguous()``, when known to be true (a candidate for
        its group's bucket, Note [release order], 1(b)). ``version``: ``t``'s version
        when it was saved (default: now)."""
        nbytes = end - start
        if version is None:
            version = t._version
        key = storage._cdata
        copies = self.storages.get(key)
        copy = None
        dtype = t.dtype
        if copies is not None:
            itemsize = t.element_size()
            for c in copies:
                if type(c) is tuple:
                    # member i of a bucket, its whole storage: any tensor of its dtype on
                    # that storage is a view of its place in the bucket
                    bucket, i = c
                    if (
                        bucket.versions[i] != version
                        or bucket.dtype is not dtype
                        or bucket.host is None
                    ):
                        continue
                    if bucket.sources is None:  # released: the storage may be gone
                        watched = bucket.watched
                        ref = None if watched is None else watched.get(i)
                        if ref is None or ref.expired():
                            continue
                    if bucket.owner != group.index:
                        return self._keep("shared", group, t)
                    bucket.refs += 1
                    group.live += 1
                    offset = bucket.offsets[i] + t.storage_offset()
                    return Gathered(self, group, bucket, i, t.size(), t.stride(), offset)
                if c.version != version:
                    continue
                if (
                    c.start <= start
                    and end <= c.end
                    and (start - c.start) % itemsize == 0
                    and c.host is not None
                    and not c.ref.expired()  # else another storage reuses the address
                ):
                    copy = c
                    break
        if copy is not None and copy.owner != group.index:
            return self._keep("shared", group, t)  # transferred once, by its owner
        if copy is None:
            total = storage.nbytes()
            if (
                contiguous
                and start == 0
                and end == total
                and nbytes <= _GATHER_MAX_BYTES
                and self.gathering
            ):
                gathered = self._gather(t, group, key, copies, version, dtype)
                if gathered is not None:
                    return gathered
        size, stride = t.size(), t.stride()
        whole = False  # Offloaded.whole
        if copy is None:
            # A view whose span covers at least half of its storage (the chunks of a
            # fused QKV or gate/up projection: each spans almost all of it) takes the
            # whole storage, so its sibling views find their bytes already copied.
            c_start, c_end = start, end
            if 2 * nbytes >= total:
                c_start, c_end = 0, total
            else:
                if wide is None:
                    wide = _base_span(t)
                if wide is not None:
                    c_start, c_end = min(wide[0], start), max(wide[1], end)
            span_bytes = c_end - c_start
            codec = self._codec(t, c_start, c_end) if self.compress else None
            sent = span_bytes
            if codec is not None:
                sent = _compress.packed_nbytes(span_bytes // t.element_size())
            block = self.rt.pool.allocate(sent)
            if block is None:
                self._warn_host_limit(sent)
                return self._keep("host_limit", group, t)
            copy = _Copy(group.index, c_start, c_end, version, block, codec, storage, total)
            alias = t.detach()  # same storage and version counter (the device reference)
            if codec is None and start == 0 and end == total and t.is_contiguous():
                # The tensor's elements are exactly its storage's bytes: copy it into a
                # host view of its own dtype and geometry (same bytes, same places), which
                # saves a byte view of each side (_Copy.spec).
                copy.spec = (dtype, size, stride)
                copy.host_view = view = block.typed(dtype, size, stride)
                pair = (alias, view, None)
                whole = True
            else:
                copy.host_view = view = block.typed(torch.uint8, (sent,), (1,))
                pair = (_packing.as_bytes(t, c_start, c_end), view, codec)
            self._queue_d2h(pair, group, sent)
            group.device_refs.append((alias, version, copy))
            if copies is None:
                self.storages[key] = [copy]
            else:
                copies.append(copy)
            self._count_sent(group, dtype, sent, span_bytes if codec is not None else None)
            group.copies[id(copy)] = copy  # its first user
            copy.users = 1
        else:
            if copy.spec is not None:  # another tensor of the same storage, maybe the same one
                whole = start == copy.start and copy.spec == (dtype, size, stride)
            copies_of_group = group.copies
            if id(copy) not in copies_of_group:
                copies_of_group[id(copy)] = copy
                copy.users += 1
        copy.refs += 1
        group.live += 1
        return Offloaded(self, group, copy, dtype, size, stride, start - copy.start, whole)

    def _gather(
        self,
        t: torch.Tensor,
        group: _Group,
        key: int,
        copies: list[_Copy | tuple[_Bucket, int]] | None,
        version: int,
        dtype: torch.dtype,
    ) -> Gathered | None:
        """Add the small contiguous tensor ``t`` (its whole storage) to ``group``'s
        bucket of its dtype (Note [release order], 1(b)); ``None`` when no host block
        can be reserved for a new bucket (the caller tries a copy of its own)."""
        numel = t.numel()
        bucket = self.buckets.get(dtype)
        if bucket is None or bucket.fill + numel > bucket.end:
            bucket = self._bucket_for(bucket, numel, group, dtype)
            if bucket is None:
                return None
        offset = bucket.fill
        bucket.fill = offset + numel
        i = len(bucket.offsets)
        bucket.offsets.append(offset)
        bucket.versions.append(version)
        bucket.sources.append(t.detach())  # type: ignore[union-attr]
        if copies is None:
            self.storages[key] = [(bucket, i)]
        else:
            copies.append((bucket, i))
        bucket.refs += 1
        group.live += 1
        return Gathered(self, group, bucket, i, t.size(), t.stride(), offset)

    def _bucket_for(
        self, bucket: _Bucket | None, numel: int, group: _Group, dtype: torch.dtype
    ) -> _Bucket | None:
        """A bucket of ``group`` and ``dtype`` with room for ``numel`` more elements:
        ``bucket`` (the open one, too full) grown in place, else a new one (the full
        one sealed); ``None`` when the host budget refuses a new one (lock held)."""
        itemsize = dtype.itemsize
        if bucket is not None:
            need = (bucket.fill + numel) * itemsize
            grow = min(max(2 * bucket.end * itemsize, need), _GATHER_BUCKET_BYTES)
            if need <= grow and self.rt.pool.extend(bucket.host, grow):  # type: ignore[arg-type]
                bucket.end = grow // itemsize
                return bucket
            self._seal(bucket)
        first = max(_GATHER_FIRST_BYTES, numel * itemsize)
        block = self.rt.pool.allocate(first)
        if block is None:
            return None
        bucket = _Bucket(group.index, first // itemsize, block, dtype)
        self.buckets[dtype] = bucket
        self.all_buckets.append(bucket)
        group.copies[id(bucket)] = bucket
        bucket.users = 1
        # one entry for all its members: the group has device references to release
        group.device_refs.append((None, -1, bucket))
        return bucket

    def _seal(self, bucket: _Bucket) -> None:
        """Close a bucket to new members: one flat device copy of them (a kernel on the
        current stream, after the kernels that produced them) queued for D2H and its
        host block trimmed (Note [release order], 1(b); lock held). Its members' tensors
        stay until the release."""
        dtype = bucket.dtype
        if self.buckets.get(dtype) is bucket:
            del self.buckets[dtype]
        sources = bucket.sources
        flat = _flatten_dense_tensors(sources)
        n = bucket.fill
        nbytes = n * dtype.itemsize
        block: HostBlock = bucket.host  # type: ignore[assignment]
        self.rt.pool.trim(block, nbytes)
        bucket.end = nbytes  # from now on, bytes as in every copy
        size = torch.Size((n,))
        bucket.spec = (dtype, size, (1,))
        bucket.host_view = view = block.typed(dtype, size, (1,))
        owner = self.groups[bucket.owner]
        self.d2h_transient.append(flat)  # before the queue may be issued
        self._queue_d2h((flat, view, None), owner, nbytes)
        self._count_sent(owner, dtype, nbytes)

    def _queue_d2h(
        self, pair: tuple[torch.Tensor, torch.Tensor, torch.dtype | None], group: _Group, sent: int
    ) -> None:
        """Queue one D2H copy of ``sent`` bytes for ``group``, and issue the queue when
        it holds a batch or this copy is large (Note [release order], 1; lock held)."""
        queue = self.d2h_queue
        queue.append(pair)
        if len(queue) >= _D2H_BATCH or sent >= _D2H_EAGER_BYTES:
            self._flush_d2h(group, seal=False)

    def _count_sent(
        self, group: _Group, dtype: torch.dtype, sent: int, before: int | None = None
    ) -> None:
        """Count a copy of ``sent`` bytes of ``dtype`` made for ``group``; ``before``:
        the span's bytes when the copy is compressed (``sent`` is its packed size)."""
        group.stats.bytes_offloaded += sent
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = _dtype_name(dtype)
        stats = self.stats
        if before is not None:
            name += " as fp8"
            stats.compress_bytes_before += before
            stats.compress_bytes_after += sent
        by_dtype = stats.bytes_by_dtype
        by_dtype[name] = by_dtype.get(name, 0) + sent

    def _release_members(self, bucket: _Bucket) -> int:
        """The release of a bucket's members (Note [release order], 3): the in-place
        check of each, then its device tensor dropped. Returns the bytes of the
        storages this frees. A storage held by nothing but the bucket (and the wrapper
        the count makes) is freed, and its member can no longer be found; one that
        lives on is watched, since its address cannot be reused while it lives."""
        sources, bucket.sources = bucket.sources, None
        if not sources:
            return 0
        versions = bucket.versions
        freed = 0
        for i, t in enumerate(sources):
            if t._version != versions[i]:
                if bucket.poisons is None:
                    bucket.poisons = {}
                bucket.poisons[i] = inplace_message(t, versions[i])
            if _storage_use_count(t) <= 2:
                freed += t.nbytes
                versions[i] = -1
            else:
                if bucket.watched is None:
                    bucket.watched = {}
                bucket.watched[i] = StorageWeakRef(t.untyped_storage())
        return freed

    def _codec(self, t: torch.Tensor, start: int, end: int) -> torch.dtype | None:
        """The dtype to quantize the span ``[start, end)`` of ``t``'s storage from
        (``compress="fp8"``), or ``None`` to send its bytes exactly: integer, bool and
        fp8 tensors, spans that are not whole elements of ``t``'s dtype, and tensors
        ``compress_filter`` exempts; without a filter, fp32 tensors (in mixed precision
        the softmax and norm statistics: measured, they carry half the gradient error
        for 0.14 % of the bytes on ref-8L)."""
        dtype = t.dtype
        if dtype not in _compress.COMPRESSIBLE:
            return None
        itemsize = dtype.itemsize
        if start % itemsize or end % itemsize:
            return None
        flt = self.cfg.compress_filter
        if flt is None:  # the default: 16-bit floats only (docs/compress.md)
            return dtype if dtype in _compress.HALF else None
        return dtype if flt(t) else None

    def _flush_d2h(self, group: _Group | None, seal: bool = True) -> None:
        """Issue the queued D2H copies, those of the open buckets first unless ``seal``
        is false (lock held). Sealing also places ``group``'s held-back saves first
        (Note [release order], 1(c))."""
        if seal:
            if group is not None and group.deferred is not None:
                self._place_deferred(group)
            if self.buckets:
                for bucket in list(self.buckets.values()):
                    self._seal(bucket)
        queue = self.d2h_queue
        if queue:
            self.d2h_queue = []
            transient, self.d2h_transient = self.d2h_transient, []
            times = group.times if group is not None else None
            fence = None if self.capture else self.rt.pool.h2d_fence
            # a flat copy of a bucket was written just now: only a mark taken now
            # orders its copy after the kernel that wrote it
            ready = None if transient else self.d2h_ready
            self.backend.d2h(queue, fence, times, transient, ready)  # type: ignore[union-attr]

    def _warn_host_limit(self, nbytes: int) -> None:
        if not self.rt.warned_host_limit:
            self.rt.warned_host_limit = True
            pool = self.rt.pool
            warn_at_caller(
                f"offload: the host memory budget is reached ({pool.reserved_bytes} of "
                f"host_memory_limit={pool.limit} bytes reserved; a tensor of {nbytes} bytes "
                f"stays on the device, reason 'host_limit'). Raise host_memory_limit to "
                f"offload more; training stays correct.",
                RuntimeWarning,
            )

    def _release(self, group: _Group) -> None:
        """Drop a group's device references once its copies are done (lock held)."""
        if group.released:
            return
        group.released = True
        if not group.device_refs:
            return
        self.backend.wait(group.stream, group.d2h_done, group.times)  # type: ignore[union-attr]
        mine: dict[int, _Copy] = {}
        gathered = 0
        for t, version, copy in group.device_refs:
            if t is None:
                gathered += self._release_members(copy)  # type: ignore[arg-type]
                continue
            if t._version != version:
                copy.poison = inplace_message(t, version)
            mine[id(copy.ref)] = copy
        del t  # the loop variable would keep the last tensor alive
        group.device_refs.clear()
        # Storages whose last reference was ours are free now: that is the device memory
        # this release gave back (a storage that another group or the caller still holds
        # travelled for nothing, and is not counted). One storage may have several copies.
        freed: dict[int, int] = {}
        for copy in mine.values():
            if copy.ref.expired():  # type: ignore[union-attr]
                freed[copy.ref.cdata] = copy.storage_nbytes  # type: ignore[union-attr]
        group.stats.bytes_released += sum(freed.values()) + gathered

    # ---- manual mode (get_cpu_offload_context(manual_synchronization=True)) -----------

    def _hold(
        self, t: torch.Tensor, group: _Group, start: int, end: int, wide: tuple[int, int] | None
    ) -> Held:
        """Keep ``t`` on the device until ``start_offload_layer`` (lock held). Counted as
        ``not_selected`` until then: a layer that is never started is not offloaded."""
        handle = Held(Kept(t))
        nbytes = _nbytes(t)
        group.held.append((weakref.ref(handle), start, end, wide, nbytes))
        group.stats.bytes_kept["not_selected"] += nbytes
        return handle

    def manual_start(self, group: _Group) -> None:
        """``start_offload_layer``: start the copies of the group's held saves, issue
        them, and record the group's D2H event (Note [release order], 1-2)."""
        with self.rt.lock:
            self.rt.drain()
            had_copies = bool(group.copies)
            group.phase = "offload_started"
            held, group.held = group.held, []
            kept = group.stats.bytes_kept
            for ref, start, end, wide, nbytes in held:
                kept["not_selected"] -= nbytes
                self._start_held(ref(), group, start, end, wide)
            stream = group.stream
            if stream is not None and self.backend is not None and self.backend.is_async:
                # the copies wait for the stream the layer ran on (4.1(a)), whichever
                # stream is current where the caller calls start_offload_layer
                with torch.cuda.stream(stream):
                    self._flush_d2h(group)
            else:
                self._flush_d2h(group)
            if group.device_refs and self.backend is not None:
                group.d2h_done = self.backend.record_d2h()
            if group.copies and not had_copies and self.forward_done:
                self.awaiting += 1
                self.backward_done = False

    def _start_held(
        self,
        handle: Held | None,
        group: _Group,
        start: int,
        end: int,
        wide: tuple[int, int] | None,
    ) -> None:
        if handle is None:  # its graph is gone
            return
        inner = handle.inner
        t = inner.tensor  # type: ignore[union-attr]
        if t._version != inner.version:  # type: ignore[union-attr]
            return  # changed in place since it was saved: Kept.unpack raises
        handle.inner = self._copy(t, group, t.untyped_storage(), start, end, wide)

    def manual_release(self, group: _Group) -> None:
        """``release_activation_forward_gpu_memory``: Note [release order], 3."""
        with self.rt.lock:
            self.rt.drain()
            group.phase = "released"
            self._release(group)

    def manual_reload(self, group: _Group) -> None:
        """``start_reload_layer``: Note [release order], 4."""
        with self.rt.lock:
            self.rt.drain()
            group.phase = "reload_started"
            if not group.reloaded:
                self._reload(group)

    def flush_for(self, tensors: list[torch.Tensor]) -> bool:
        """``offload.start_offload``: issue the queued D2H copies now if one of them
        reads the storage of one of ``tensors``; returns whether it did."""
        with self.rt.lock:
            if self.open is not None and self.open.deferred is not None:
                self._place_deferred(self.open)
            queue = self.d2h_queue
            if not queue and not self.buckets:
                return False
            keys = {t.untyped_storage()._cdata for t in tensors}
            sources = [src for src, _, _ in queue]
            for bucket in self.buckets.values():
                sources += bucket.sources  # type: ignore[operator]
            if not any(src.untyped_storage()._cdata in keys for src in sources):
                return False
            self._flush_d2h(self.open)
            return True

    # ---- backward --------------------------------------------------------------------

    def _backward_started(self, index: int, _grad: Any) -> None:
        with self.rt.lock:
            self.rt.drain()
            for j in self.plan.reload_at.get(index, ()):
                if j < len(self.groups):
                    self._reload(self.groups[j])

    def _input_grad(self, index: int, _grad: Any) -> None:
        """A gradient of a layer input is complete; after all of them, drop the group."""
        with self.rt.lock:
            self.rt.drain()
            group = self.groups[index]
            group.inputs_seen += 1
            if group.inputs_seen >= group.inputs_expected:
                group.inputs_seen = 0
                self._drop(group)

    def _reload(self, group: _Group) -> None:
        """Start the H2D copies of a group's spans (Note [release order], 4; lock held)."""
        if not group.copies or self.aborted:
            return
        backend = self.backend
        stream = group.stream if group.stream is not None else backend.current_stream()  # type: ignore[union-attr]
        self._flush_d2h(None)
        todo = [c for c in group.copies.values() if c.buffer is None and c.host is not None]
        requests = [c.end - c.start if c.spec is None else c.spec for c in todo]
        buffers = self.buffers.take(backend, requests, stream)  # type: ignore[arg-type]
        pairs: list[Any] = []
        waits: list[Any] = []  # the D2H event of each group that made one of the copies
        groups = self.groups
        owners: set[int] = set()
        reloaded = 0
        for copy, buffer in zip(todo, buffers):
            # not waited for before the buffer is visible: an unpack that reads both
            # without the lock (Gathered.unpack) then takes the locked path and waits
            copy.waited = False
            copy.buffer = buffer
            host = copy.host
            pairs.append((copy.host_view, buffer, copy.codec))
            reloaded += host.length  # type: ignore[union-attr]
            if copy.owner not in owners and self.capture != "layer":
                # one wait per event is enough; none in a per-layer capture, whose forward
                # graph ended after its copies (and whose events belong to that graph)
                owners.add(copy.owner)
                owner = groups[copy.owner]
                if owner.d2h_done is None and owner.device_refs:
                    owner.d2h_done = backend.record_d2h()  # type: ignore[union-attr]
                if owner.d2h_done is not None:
                    waits.append(owner.d2h_done)
        if pairs:
            event = backend.h2d(pairs, waits, stream, group.times)  # type: ignore[union-attr]
            for copy in todo:
                copy.reload_event = event
                copy.stream = stream
                copy.waited = False
                copy.holders = copy.users  # kept until every user group is done
            self.stats.bytes_reloaded += reloaded
            if event is not None and not self.capture:
                self.rt.pool.h2d_fence = event
        group.reloaded = True

    def reloaded_buffer(self, handle: Offloaded) -> torch.Tensor:
        """The reloaded bytes of ``handle``'s copy, safe to read on the current stream
        (Note [release order], 5)."""
        rt = self.rt
        with rt.lock:
            if rt.graveyard:
                rt.drain()
            copy = handle.copy
            if copy.poison is not None:
                raise RuntimeError(copy.poison)
            if copy.host is None:
                raise RuntimeError(
                    "offload: this saved tensor's host copy was freed because the forward "
                    "that saved it raised an exception; run the forward again before "
                    "calling backward"
                )
            buffer = copy.buffer
            if buffer is not None and copy.waited:  # reloaded and waited for: step 5 done
                return buffer
            group = handle.group
            if copy.buffer is None:
                self._reload(group)  # on demand
            if not copy.waited:
                # The backward of a layer runs on the stream its forward ran on (autograd
                # guarantees it), which is group.stream: it waits once per reload event,
                # for every copy that event covers.
                event = copy.reload_event
                stream = group.stream
                if stream is None:
                    self.backend.wait_current(event, group.times)  # type: ignore[union-attr]
                else:
                    self.backend.wait(stream, event, group.times)  # type: ignore[union-attr]
                for c in group.copies.values():
                    if c.reload_event is event:
                        c.waited = True
                copy.waited = True
            return copy.buffer  # type: ignore[return-value]

    def _drop(self, group: _Group) -> None:
        """A group's backward is over: give up its reloaded buffers (lock held)."""
        if group.reloaded:
            group.reloaded = False
            for copy in group.copies.values():
                copy.holders -= 1
                if copy.holders <= 0:
                    copy.holders = 0
                    self._drop_buffer(copy, reuse=True)
        if not group.dropped and group.copies:
            group.dropped = True
            self.awaiting -= 1
            if self.awaiting <= 0 and self.forward_done:
                self._backward_over()

    def _backward_over(self) -> None:
        """Every group with copies finished its backward (lock held): free the spares
        and remove this step's tensor hooks. Inside a backward the removal is queued to
        run when the backward ends (a hook must not remove hooks that autograd may be
        iterating); outside one (handles died with their graph) it happens now."""
        self.backward_done = True
        self.buffers.clear()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.remove_hooks)
        except RuntimeError:  # not inside a backward
            self.remove_hooks()

    def _drop_buffer(self, copy: _Copy, reuse: bool = False) -> None:
        if copy.buffer is not None:
            if not copy.waited:
                self.backend.wait(copy.stream, copy.reload_event)  # type: ignore[union-attr]
            if reuse and self.buffers.reuse and not self.backward_done:  # kept as a spare
                spec = copy.spec
                self.buffers.give(copy.buffer, copy.end - copy.start if spec is None else spec)
            copy.buffer = None

    # ---- handle death ----------------------------------------------------------------

    def handle_died(self, copy: _Copy, group: _Group | None) -> None:
        """Called from ``Offloaded.__del__``, on any thread (Note [release order], 7)."""
        rt = self.rt
        if rt.lock.acquire(blocking=False):
            try:
                if rt.graveyard:
                    rt.drain()
                self._retire(copy, group)
            finally:
                rt.lock.release()
        else:
            rt.graveyard.append((self, copy, group))

    def _retire(self, copy: _Copy, group: _Group | None) -> None:
        copy.refs -= 1
        if copy.refs == 0:
            if copy.buffer is not None:
                self._drop_buffer(copy, reuse=not self.aborted)
            if copy.host is not None:
                if self.capture and not self.aborted:
                    self.rt.graph_blocks.append(copy.host)  # replays write it
                else:
                    self.rt.pool.free(copy.host)
                copy.host = None
                copy.host_view = None
        if group is not None:
            group.live -= 1
            if group.live == 0:
                if self.manual and not group.released and self.forward_done:
                    # manual mode, never released: nothing reads the device bytes any
                    # more; drop them once the copy that reads them is waited for
                    self._release(group)
                self._drop(group)

    # ---- stats -----------------------------------------------------------------------

    def read_stats(self) -> OffloadStats:
        """The stats, brought up to date: deaths queued by other threads processed,
        totals summed over the groups, the pool figures refreshed and, with
        ``timing=True``, the copy times resolved (which waits on the host for the
        recorded copies)."""
        stats = self.stats
        with self.rt.lock:
            self.rt.drain()
            kept = dict(self.outside)
            offloaded = released = 0
            for g in self.groups:
                s = g.stats
                offloaded += s.bytes_offloaded
                released += s.bytes_released
                for reason, n in s.bytes_kept.items():
                    kept[reason] += n
            stats.bytes_kept = kept
            stats.bytes_offloaded = offloaded
            stats.bytes_released = released
            pool = self.rt._pool
            if pool is not None:
                stats.host_pool_bytes = pool.in_use_bytes
                stats.host_pool_reserved_bytes = pool.reserved_bytes
                stats.host_pool_peak_bytes = pool.peak_bytes
            records = [(g.stats, list(g.times)) for g in self.groups if g.times is not None]
        if records:
            _timing.resolve(records)
        return stats
