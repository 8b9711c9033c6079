"""One forward of an activation offloader: its groups, their hooks and its stats.

:class:`Step` opens and closes a group per layer call, places the saves (``_saves.py``),
drives the groups' release, reload and drop (``_group.py``) and removes its hooks when
its backward is over. Copies are ``_transfer.HostCopy``; the runtime is ``_runtime.py``.

Note [release order]
~~~~~~~~~~~~~~~~~~~~
When is a device block freed, and why is that safe? Numbers like 4.1(a) name the
invariants: (a) a D2H copy reads bytes only after the kernel that wrote them; (b) no
kernel reuses a block before its D2H copy read it; (c) no unpack reads a reload before
its H2D copy landed; (d) no D2H copy overwrites a host block an H2D copy still reads;
(e) no reload buffer is reused while its H2D copy or a tensor in it may still use it.

Forward, group g (the call of layer g), offloaded:

1. *Pack.* A saved tensor's byte span is queued for a host block; the queue is issued
   in batches (one wait and one stream switch per batch), a large span at once, and
   always before the group closes. The D2H stream first waits for the compute stream
   (a) and for the pool's H2D fence (d). The group keeps ``t.detach()`` and its version;
   autograd gets a handle (``_handles.py``), never the tensor: a tensor saved by its own
   producer would otherwise form a cycle through its ``grad_fn``.
1(b). *Buckets.* A small contiguous tensor that is its whole storage joins its group's
   bucket of its dtype: one host block, one flat device copy (a kernel on the compute
   stream, so after its producers) at the seal, one D2H and one H2D. Below about a MiB
   the host time of a copy of its own exceeds its link time. The flat copy is held by
   nothing but the backend, which marks it used by the D2H stream (b). The members'
   tensors are held until the release, which checks each one's version.
1(c). *First layer call.* Group 0 places its saves after its kernels are queued: the
   device starts the step idle, so host time spent placing before them is device time
   lost. At its close when the next call is offloaded too (the copies keep their order);
   otherwise at the start of the first later call that finds the device still short of
   the previous call's start (the host is then a call ahead: a model that synchronises
   before its layers, as Hugging Face's mask check does, gives it no lead at first),
   and at the latest before ``LATE_CALLS`` calls, its release, an offloaded call or the
   forward's end. A large save takes a ready mark at save time, so its copy still waits
   only for its producer (a). Nothing is released before the placement.
1(d). *Inputs.* A save that is one of the call's own inputs, on the same storage and at
   the version it had when the call started, was written before the call: its copy
   waits only for a mark taken on the compute stream at the call's start (a), so it
   runs beside the call's kernels. A checkpointed call saves nothing but its inputs,
   after its forward's kernels are queued; waiting for those, the copy would still be
   running when the next call's start releases the group (3), and stall it.
2. *Close.* An event recorded on the D2H stream covers every copy of the group.
3. *Release.* At the start of layer ``r = max(g + 1, L - k + j)`` (g the j-th of the
   k offloaded groups; ``r == L`` only for the last call planned, released at its own
   close: the head and the loss that run next often hold the step's peak, and nothing
   before the backward needs its saves) the compute stream waits for that event (the
   device waits, the host does not) and the group drops its device references (b). A
   version changed since the pack poisons the copy: its unpack raises autograd's
   "modified by an inplace operation" error.

Backward (possibly on autograd's device threads):

4. *Reload.* When the backward of layer ``q`` starts (the first gradient of its
   outputs), the groups due at ``q`` reload: buffers are taken in the compute stream's
   pool; the H2D stream waits for the compute stream (e) and for the D2H event of each
   copy's group, copies, and records an event that becomes the pool's H2D fence (d).
5. *Unpack.* The first unpack of a copy makes the group's stream (autograd runs a
   node's backward on its forward's stream) wait for the reload event (c), once per
   event. A copy not reloaded yet is reloaded on demand.
6. *Drop.* A group gives up its buffers when the gradients of its inputs are complete
   or its last handle dies; a buffer whose event nobody waited for is waited for first
   (e). A copy shared by several groups keeps its buffer until all of them dropped it.
   A save made between two calls joins the next call's group, but its backward runs
   after that group's inputs' gradients: a copy it points at keeps its buffer until its
   last handle dies (7) or the previous group drops, instead of being reloaded again
   on demand.
7. *Death.* The last handle of a copy returns its host block to the pool (the next D2H
   into it waits for the fence, 1). A handle can die on any thread: with the lock busy,
   the work is queued and done by the next caller (``Runtime.later``).
8. *Hooks.* The tensor hooks of 4 and 6 are removed at the end of the step's backward
   (``queue_callback``), or at the next forward when its graph died unused.

*Compressed copies* add a codec kernel on a high-priority stream on each side, ordered
between the same waits and events: the D2H event still follows every read of the
device bytes, the reload event every write of the buffer (``_device._Staging``).

*Manual mode* changes who triggers the steps, not what they wait for: saves are held
until ``start_offload_layer`` (1-2), released only by the caller (3, the same wait), and
reloaded by ``start_reload_layer`` or on demand (4-5). A started group whose handles
all die unreleased is released then, after the same wait.

*CUDA graphs* record the same waits as graph edges. A captured copy's host block is
bound to the graph (replays write it) and kept until ``free_graph_memory()``; captured
copies neither wait for nor set the H2D fence (no other copy reuses their blocks, and a
capture cannot wait on an outside event). Every forked stream rejoins: in a whole-step
capture through the waits of 3 and 5; per layer, at the group's own close and reload.

*Abort.* An exception in the forward waits for the outstanding D2H copies, drops every
device reference and returns every host block at once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from offload._core import _packing, _timing
from offload._core._device import Backend
from offload._core._runtime import Runtime
from offload._core._transfer import HostCopy
from offload.activations._buffers import ReloadBuffers
from offload.activations._group import OPEN, RELEASED, Group, GroupLife
from offload.activations._handles import (
    Offloaded,
    Pending,
)
from offload.activations._policy import MANUAL, RECORDINGS, SCHEDULED, Recording, Trigger
from offload.activations._saves import Saves, _Bucket, _nbytes
from offload.activations._schedule import Schedule
from offload.stats import KEEP_REASONS, LayerStats, OffloadStats

__all__ = ["LATE_CALLS", "Step"]

#: Most calls that the first call's placement waits for the host to get ahead (Note
#: [release order], 1(c)): its copies must still land before its release.
LATE_CALLS = 4

_tensors_in = _packing.tensors_requiring_grad


def _remove_all(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()


class Step(Saves, GroupLife):
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
        self.groups: list[Group] = []
        self.open: Group | None = None
        self.depth = 0  # nested calls of registered layers inside an open group
        #: the modules of the layer calls after the first, in a forward that offloads
        #: nothing (Note [untracked calls]); None: every call is a group
        self.untracked: list[torch.nn.Module] | None = None
        self.untracked_depth = 0  # nested registered layers inside an untracked call
        self.pending: list[tuple[Pending, torch.Tensor]] = []
        self.forward_done = False
        self.aborted = False
        self.backward_done = False
        self.storages: dict[int, list[HostCopy | tuple[_Bucket, int]]] = {}
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
        #: a measuring forward of offload_layers="auto": every group is observed
        self.probe = False
        #: ... and every group keeps the saved-tensor hooks, those not offloaded counting
        #: the bytes they would send (a first measurement; later ones predict the bytes)
        self.counts = False
        #: offload_layers="auto"'s observer of this forward (offload/activations/_auto/_probe.py):
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
        #: who triggers the groups' transitions, where their copies are recorded
        #: (``_policy.py``); set through ``manual`` and ``capture`` before the first group
        self.trigger: Trigger = SCHEDULED
        self.recording: Recording = RECORDINGS[None]
        #: ``trigger.holds_saves``, read for every offloaded save
        self.holds_saves = False
        #: small tensors travel in buckets (Note [release order], 1(b)): not with
        #: compression, in captures or in manual mode (set when a group opens)
        self.gathering = False
        #: while deferred saves are placed (1(c)): the mark after the one being placed
        #: was produced, for the D2H copies issued then (None: mark now)
        self.d2h_ready: Any = None
        #: group 0, closed with its saves not placed yet, and the compute stream's mark
        #: taken at the last call boundary since (Note [release order], 1(c))
        self.late: Group | None = None
        self.late_mark: Any = None
        #: the call at whose open the late group's saves were placed (None: at its close)
        self.placed_late_at: int | None = None
        #: the next layer call runs recomputed, its inputs offloaded: settled by the
        #: offloader before the call starts (Note [recomputed calls])
        self.recompute_next = False

    @property
    def manual(self) -> bool:
        """Manual mode (``get_cpu_offload_context(manual_synchronization=True)``)."""
        return self.trigger.manual

    @manual.setter
    def manual(self, manual: bool) -> None:
        self.trigger = MANUAL if manual else SCHEDULED
        self.holds_saves = self.trigger.holds_saves

    @property
    def capture(self) -> str | None:
        """``None`` (eager), ``"step"`` (one CUDA graph for the whole step) or
        ``"layer"`` (each layer call its own graph)."""
        return self.recording.capture

    @capture.setter
    def capture(self, kind: str | None) -> None:
        recording = RECORDINGS.get(kind)
        if recording is None:
            raise ValueError(f"capture={kind!r}: must be None, 'step' or 'layer'")
        self.recording = recording

    @property
    def stats_double_buffer_reuses(self) -> int:
        return self.buffers.reuses

    @property
    def spares(self) -> dict[Any, list[torch.Tensor]]:
        return self.buffers.spares

    # ---- forward: layer boundaries ----------------------------------------------------

    def open_group(self, module: torch.nn.Module | None, inputs: Any = None) -> None:
        with self.rt.lock:
            self.rt.drain()
            if self.open is not None:  # a registered layer called inside another one
                self.depth += 1
                return
            index = len(self.groups)
            if self.late is not None:
                self._place_late_or_wait(index)
            recording, trigger = self.recording, self.trigger
            recording.check_open(self)
            if index < self.plan.num_groups:
                offload = index in self.plan.offloaded
            else:
                offload = bool(self.plan.select(index, module))
            stream = self.backend.current_stream() if self.backend is not None else None
            self.gathering = recording.gathers and trigger.gathers and not self.compress
            group = Group(index, module, offload, stream)
            if self.recompute_next:
                group.stats.recomputed = True
                self.recompute_next = False
            if offload and index == 0 and recording.gathers and trigger.gathers and not self.probe:
                group.deferred = []  # Note [release order], 1(c)
            if self.cfg.timing:
                group.times = []
            tensors = _tensors_in(inputs, []) if offload and inputs is not None else []
            if tensors and group.deferred is None and trigger.gathers:
                self._mark_inputs(group, tensors)
            self.groups.append(group)
            self.stats.layers.append(group.stats)
            self.open = group
            for j in self.plan.release_at.get(index, ()):
                if j < index:
                    self._release(self.groups[j])
            pending, self.pending = self.pending, []
            for handle, t in pending:
                if offload or self.counts:
                    inner = handle.inner = self._place(t, group)
                    if isinstance(inner, Offloaded):
                        inner.copy.late = True  # Note [release order], 6
                else:
                    group.stats.bytes_kept["not_selected"] += _nbytes(t)
        if self.watch is not None:
            self.watch.opened(self, group, inputs)
        if offload and inputs is not None:
            group.inputs_expected = len(tensors)
            # Plain tensor hooks, not register_multi_grad_hook(mode="all"): that one keeps
            # the inputs' grad_fns in its closure, which the hook registered on those very
            # nodes turns into a reference cycle that keeps the whole graph alive.
            hook = functools.partial(self._input_grad, index)
            for t in tensors:
                self.hooks.append(t.register_hook(hook))

    def _mark_inputs(self, group: Group, tensors: list[torch.Tensor]) -> None:
        """Mark the compute stream at the start of offloaded call ``group`` and note its
        inputs' storages and versions, for copies of them that may start there (Note
        [release order], 1(d); lock held). Eager recording only: a capture's copies
        keep the waits it records."""
        if self.recording.capture is not None:
            return
        backend = self.rt.backend(tensors[0].device)
        if not backend.is_async:  # every copy completes at once: nothing to gain
            return
        group.input_mark = backend.mark_ready()
        group.input_versions = {t.untyped_storage()._cdata: t._version for t in tensors}

    def close_group(self, outputs: Any = None) -> None:
        with self.rt.lock:
            if self.depth:
                self.depth -= 1
                return
            group = self.open
            if group is None:
                return
            self.open = None
            group.close()
            last = group.offload and group.index == self.plan.num_groups - 1
            releases = self.recording.releases_at_close or (last and self.trigger.releases_at_end)
            mark = None if releases else self._late_mark(group)
            if mark is not None:  # Note [release order], 1(c)
                self.late, self.late_mark = group, mark
            else:
                self._issue(group)
            if releases:
                # this layer's graph ends with the layer: join its D2H now (Note
                # [release order], "CUDA graphs"); or the last call planned (3)
                self._release(group)
            index = group.index
        if self.watch is not None:
            self.watch.closed(self, group, outputs)
        if outputs is not None:
            self.register_trigger(index, outputs)

    def _late_mark(self, group: Group) -> Any:
        """A mark of the compute stream when ``group``'s held-back saves may wait past
        its close (Note [release order], 1(c)); ``None``: place them now (lock held)."""
        deferred = group.deferred
        if not deferred or self.depth:
            return None
        plan = self.plan
        nxt = group.index + 1
        if (
            nxt >= plan.num_groups
            or nxt in plan.offloaded
            or group.index in plan.release_at.get(nxt, ())
        ):
            return None
        backend = self.rt.backend(deferred[0][1].device)
        # the synchronous backend has no device queue for the host to get ahead of
        return backend.mark_ready() if backend.is_async else None

    def _place_late_or_wait(self, index: int) -> None:
        """At the open of call ``index``: place the late group's saves when the device is
        still short of the mark taken at the last call's open (the host is a call
        ahead) or when waiting longer would delay their copies past a limit, else take
        a new mark (Note [release order], 1(c); lock held)."""
        late = self.late
        assert late is not None and late.deferred
        plan = self.plan
        nxt = index + 1
        due = (
            index - late.index >= LATE_CALLS
            or nxt >= plan.num_groups
            or index in plan.offloaded
            or late.index in plan.release_at.get(nxt, ())
            or late.index in plan.release_at.get(index, ())
        )
        if due or (index > late.index + 1 and not self.late_mark.query()):
            self._place_late(index)
            return
        self.late_mark = self.rt.backend(late.deferred[0][1].device).mark_ready()

    def _place_late(self, index: int) -> None:
        """Place the late group's saves and issue their copies, at the open of call
        ``index`` (lock held)."""
        group, self.late, self.late_mark = self.late, None, None
        assert group is not None
        self.placed_late_at = index
        self._issue(group)

    def flush_for(self, tensors: list[torch.Tensor]) -> bool:
        """``offload.start_offload``: issue the queued D2H copies now if one of them
        reads the storage of one of ``tensors``; returns whether it did."""
        with self.rt.lock:
            if self.late is not None:
                self._place_late(len(self.groups))
            if self.open is not None and self.open.deferred is not None:
                self._place_deferred(self.open)
            queue = self.d2h_queue
            if not queue and not self.buckets:
                return False
            keys = {t.untyped_storage()._cdata for t in tensors}
            sources = [src for src, _, _ in queue]
            for bucket in self.buckets.values():
                sources += bucket.sources  # type: ignore[arg-type]
            if not any(src.untyped_storage()._cdata in keys for src in sources):
                return False
            self._flush_d2h(self.open)
            return True

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
            if self.late is not None:
                self._place_late(len(self.groups))
            self._flush_d2h(self.open)
            self.open = None
            self.forward_done = True
            for _handle, t in self.pending:
                self.outside["outside_layers"] += _nbytes(t)
            self.pending = []
            for group in self.groups:
                if group.offload and group.state is not RELEASED and self.trigger.releases_at_end:
                    if group.state is OPEN and group.device_refs and self.backend is not None:
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
            self.late = self.late_mark = None
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
                group.abort()
            every: list[list[Any]] = [*self.storages.values(), self.all_buckets]
            for copies in every:
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

    def calls(self) -> list[Any]:
        """The modules of this forward's layer calls, in order (untracked ones included)."""
        return [g.module for g in self.groups] + (self.untracked or [])

    def remove_hooks(self) -> None:
        """Remove every hook this step registered on tensors (idempotent)."""
        _remove_all(self.hooks)

    @property
    def finished(self) -> bool:
        """Its backward ended, or its graph is gone: its hooks are of no more use."""
        return self.backward_done or not any(g.live for g in self.groups)

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
            if self.untracked:  # listed when read (Note [untracked calls])
                layers = stats.layers
                for i in range(len(layers), len(self.groups) + len(self.untracked)):
                    layers.append(LayerStats(index=i, offloaded=False))
            stats.bytes_kept = kept
            stats.bytes_offloaded = offloaded
            stats.bytes_released = released
            stats.synchronous = self.backend is not None and not self.backend.is_async
            pool = self.rt._pool
            if pool is not None:
                stats.host_pool_bytes = pool.in_use_bytes
                stats.host_pool_reserved_bytes = pool.reserved_bytes
                stats.host_pool_peak_bytes = pool.peak_bytes
            records = [(g.stats, list(g.times)) for g in self.groups if g.times is not None]
        if records:
            _timing.resolve(records)
        return stats
