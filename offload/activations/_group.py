"""One layer call of a forward (a group) and the transitions of its life.

Its copies leave the device at its close and release, come back at its reload and are
given up at its drop (Note [release order] in ``_step.py``, steps 2-7); manual mode
drives the same transitions from the caller's calls.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import offload.activations._placement as _placement
from offload._core._transfer import HostCopy
from offload.activations._buffers import _storage_use_count
from offload.activations._handles import (
    Held,
    Kept,
    Offloaded,
    Pending,
    inplace_message,
)
from offload.stats import LayerStats

if TYPE_CHECKING:
    from collections.abc import Callable

    from offload._core._device import Backend
    from offload._core._runtime import Runtime
    from offload.activations._buffers import ReloadBuffers
    from offload.activations._policy import Recording, Trigger
    from offload.activations._saves import _Bucket
    from offload.stats import OffloadStats

__all__ = [
    "CLOSED",
    "OPEN",
    "RELEASED",
    "Group",
    "GroupLife",
    "GroupState",
    "ManualPhase",
    "Reload",
]

_nbytes = _placement.kept_bytes


class GroupState(enum.IntEnum):
    """Where a group's forward stands (Note [release order], 1-3): it is ``OPEN`` while
    its layer runs, ``CLOSED`` when its D2H copies are issued, ``RELEASED`` once its
    device references are dropped (after the wait on its D2H event). Each transition
    happens once; a group released while open (the end of the forward, an abort)
    counts as closed. The backward side is :class:`Reload`, the manual caller's side
    :class:`ManualPhase`: one state field per lifecycle, each written only by the
    group's own transitions, which check where it stands (``_validate_state``)."""

    OPEN = 0
    CLOSED = 1
    RELEASED = 2


class Reload(enum.Enum):
    """Where a group's backward stands (Note [release order], 4-6): ``NONE`` before its
    first reload, ``HELD`` while it holds its reloaded buffers, ``DROPPED`` once its
    backward ended (buffers given up), ``HELD_AGAIN`` when a retained graph reloaded it
    after that. ``reloaded``: ``HELD`` or ``HELD_AGAIN``; ``dropped`` (its backward
    ended at least once): ``DROPPED`` or ``HELD_AGAIN``."""

    NONE = 0
    HELD = 1
    DROPPED = 2
    HELD_AGAIN = 3


class ManualPhase(str, enum.Enum):
    """Manual mode (``get_cpu_offload_context(manual_synchronization=True)``): which of
    the caller's calls the group has had, in their only order; the value is what
    ``ManualOffloadSynchronizer.state()`` returns."""

    SAVED = "saved"
    OFFLOAD_STARTED = "offload_started"
    RELEASED = "released"
    RELOAD_STARTED = "reload_started"


# The members as module constants: the transitions read them at every layer call, and
# reading a member off an enum class goes through its metaclass (a few plain lookups).
OPEN, CLOSED, RELEASED = GroupState.OPEN, GroupState.CLOSED, GroupState.RELEASED
_NONE, _HELD, _DROPPED, _HELD_AGAIN = Reload.NONE, Reload.HELD, Reload.DROPPED, Reload.HELD_AGAIN
#: the backward state after a reload, and after a drop that gave up buffers or ended a
#: first backward
_AFTER_RELOAD = {_NONE: _HELD, _HELD: _HELD, _DROPPED: _HELD_AGAIN, _HELD_AGAIN: _HELD_AGAIN}
_CAN_CLOSE = frozenset({OPEN})
_CAN_RELEASE = frozenset({OPEN, CLOSED})
#: the manual phase each of the caller's calls needs, and the one it leaves
_MANUAL_STEPS = {
    "start": (ManualPhase.SAVED, ManualPhase.OFFLOAD_STARTED),
    "release": (ManualPhase.OFFLOAD_STARTED, ManualPhase.RELEASED),
    "reload": (ManualPhase.RELEASED, ManualPhase.RELOAD_STARTED),
}


class Group:
    """One layer call of a forward."""

    __slots__ = (
        "copies",
        "d2h_done",
        "backward",
        "deferred",
        "device_refs",
        "held",
        "index",
        "input_mark",
        "input_versions",
        "inputs_expected",
        "inputs_seen",
        "layer",
        "live",
        "module",
        "offload",
        "phase",
        "state",
        "stats",
        "stream",
        "times",
    )

    def __init__(self, index: int, module: torch.nn.Module | None, offload: bool, stream: Any):
        self.index = index
        self.module = module
        self.offload = offload
        self.stream = stream  # the compute stream current when the layer ran
        self.copies: dict[int, HostCopy] = {}  # id -> copy, also copies made by other groups
        #: (device tensor, version at pack, its copy); (None, -1, bucket) for a bucket,
        #: whose members' tensors the bucket holds
        self.device_refs: list[tuple[torch.Tensor | None, int, HostCopy]] = []
        self.d2h_done: Any = None
        self.state = OPEN
        self.backward = _NONE
        self.live = 0  # live handles pointing at copies
        self.stats = LayerStats(index=index, offloaded=offload)
        self.layer: _placement.LayerState | None = None
        self.inputs_expected = 0
        self.inputs_seen = 0
        #: Note [release order], 1(d): a mark of the compute stream at the call's start
        #: and the storages of its inputs (``_cdata``) with their versions then
        self.input_mark: Any = None
        self.input_versions: dict[int, int] | None = None
        #: timing records (timing=True, or a measuring forward's: offload/activations/_auto/_probe.py)
        self.times: list[tuple[Any, ...]] | None = None
        #: manual mode: saves waiting for start_offload_layer: (weakref to the Held
        #: handle, span start, span end, base span or None, bytes counted not_selected)
        self.held: list[tuple[Any, int, int, tuple[int, int] | None, int]] = []
        #: manual mode: which of the caller's calls it has had
        self.phase = ManualPhase.SAVED
        #: the step's first layer call: saves placed at its close (Note [release
        #: order], 1(c)): (handle, tensor, ready mark or None); None: placed at save
        self.deferred: list[tuple[Pending, torch.Tensor, Any]] | None = None

    @property
    def closed(self) -> bool:
        return self.state >= CLOSED

    @property
    def released(self) -> bool:
        return self.state is RELEASED

    @property
    def reloaded(self) -> bool:
        """It holds its reloaded buffers now."""
        return self.backward is _HELD or self.backward is _HELD_AGAIN

    @property
    def dropped(self) -> bool:
        """Its backward ended at least once."""
        return self.backward is _DROPPED or self.backward is _HELD_AGAIN

    # ---- transitions: each checks where the group stands, then moves it ---------------

    def _validate_state(self, allowed: frozenset[GroupState], transition: str) -> None:
        if self.state not in allowed:
            raise RuntimeError(
                f"offload: layer call {self.index} cannot {transition} in state "
                f"{self.state.name} (needs {' or '.join(sorted(s.name for s in allowed))}): "
                f"an ordering error inside offload"
            )

    def close(self) -> None:
        """The layer call ended (Note [release order], 2)."""
        self._validate_state(_CAN_CLOSE, "close")
        self.state = CLOSED

    def release(self) -> bool:
        """Mark the group released (Note [release order], 3): ``False`` when it was
        already, and there is nothing to do."""
        if self.state is RELEASED:
            return False
        self._validate_state(_CAN_RELEASE, "release")
        self.state = RELEASED
        return True

    def abort(self) -> None:
        """The forward raised: the device references are gone, whatever the state."""
        self.device_refs.clear()
        self.state = RELEASED

    def reloaded_now(self) -> None:
        """Its H2D copies are issued and it holds their buffers (Note [release order], 4)."""
        self.backward = _AFTER_RELOAD[self.backward]

    def drop(self) -> tuple[bool, bool]:
        """Its backward is over (Note [release order], 6). Returns whether it held
        buffers to give up, and whether this ends its first backward (a group with
        copies): the step then has one group less to wait for."""
        backward = self.backward
        held = backward is _HELD or backward is _HELD_AGAIN
        first = (backward is _NONE or backward is _HELD) and bool(self.copies)
        if held or first:
            self.backward = _DROPPED
        return held, first

    def manual(self, call: str) -> None:
        """One of the caller's calls in manual mode (``start``, ``release``,
        ``reload``): the caller's order was checked; this checks it again and moves on."""
        needed, after = _MANUAL_STEPS[call]
        if self.phase is not needed:
            raise RuntimeError(
                f"offload: layer call {self.index} cannot {call} in manual state "
                f"{self.phase.value!r} (needs {needed.value!r}): an ordering error inside offload"
            )
        self.phase = after


if TYPE_CHECKING:

    class _LifeState:
        """The state of the Step that :class:`GroupLife` is a part of, for the type checker."""

        rt: Runtime
        backend: Backend | None
        groups: list[Group]
        stats: OffloadStats
        buffers: ReloadBuffers
        recording: Recording
        trigger: Trigger
        forward_done: bool
        aborted: bool
        awaiting: int
        remove_hooks: Callable[[], None]
        _issue: Callable[[Group], None]
        _copy: Callable[..., Any]
        _flush_d2h: Callable[..., None]

else:
    _LifeState = object


class GroupLife(_LifeState):
    """The transitions of a forward's groups: release, reload, drop, and the death of
    their handles (a part of :class:`offload.activations._step.Step`, whose state it uses)."""

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

    def _release(self, group: Group) -> None:
        """Drop a group's device references once its copies are done (lock held)."""
        if not group.release():
            return
        if not group.device_refs:
            return
        self.backend.wait(group.stream, group.d2h_done, group.times)  # type: ignore[union-attr]
        mine: dict[int, HostCopy] = {}
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
        self,
        t: torch.Tensor,
        group: Group,
        start: int,
        end: int,
        wide: tuple[int, int] | None,
    ) -> Held:
        """Keep ``t`` on the device until ``start_offload_layer`` (lock held). Counted as
        ``not_selected`` until then: a layer that is never started is not offloaded."""
        handle = Held(Kept(t))
        nbytes = _nbytes(t)
        group.held.append((weakref.ref(handle), start, end, wide, nbytes))
        group.stats.bytes_kept["not_selected"] += nbytes
        return handle

    def manual_start(self, group: Group) -> None:
        """``start_offload_layer``: start the copies of the group's held saves, issue
        them, and record the group's D2H event (Note [release order], 1-2)."""
        with self.rt.lock:
            self.rt.drain()
            had_copies = bool(group.copies)
            group.manual("start")
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
                    self._issue(group)
            else:
                self._issue(group)
            if group.copies and not had_copies and self.forward_done:
                self.awaiting += 1
                self.backward_done = False

    def _start_held(
        self,
        handle: Held | None,
        group: Group,
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

    def manual_release(self, group: Group) -> None:
        """``release_activation_forward_gpu_memory``: Note [release order], 3."""
        with self.rt.lock:
            self.rt.drain()
            group.manual("release")
            self._release(group)

    def manual_reload(self, group: Group) -> None:
        """``start_reload_layer``: Note [release order], 4."""
        with self.rt.lock:
            self.rt.drain()
            group.manual("reload")
            if not group.reloaded:
                self._reload(group)

    def _reload(self, group: Group) -> None:
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
            if copy.owner not in owners and self.recording.reload_waits_d2h:
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
            if event is not None and self.recording.fenced:
                self.rt.pool.h2d_fence = event
        group.reloaded_now()

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
            return copy.buffer

    def _drop(self, group: Group) -> None:
        """A group's backward is over: give up its reloaded buffers (lock held)."""
        held, first = group.drop()
        if held:
            for copy in group.copies.values():
                copy.holders -= 1
                if copy.holders <= 0:
                    copy.holders = 0
                    # a late copy's buffer goes with its last handle or at the previous
                    # group's drop, below (Note [release order], 6)
                    if not copy.late:
                        self._drop_buffer(copy, reuse=True)
        nxt = group.index + 1
        if nxt < len(self.groups):
            # the saves made between this call and the next were used by now: a retained
            # graph keeps their handles, not their buffers (Note [release order], 6)
            for copy in self.groups[nxt].copies.values():
                if copy.late and copy.holders == 0:
                    self._drop_buffer(copy, reuse=True)
        if first:
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

    def _drop_buffer(self, copy: HostCopy, reuse: bool = False) -> None:
        if copy.buffer is not None:
            if not copy.waited:
                self.backend.wait(copy.stream, copy.reload_event)  # type: ignore[union-attr]
            if reuse and self.buffers.reuse and not self.backward_done:  # kept as a spare
                spec = copy.spec
                self.buffers.give(copy.buffer, copy.end - copy.start if spec is None else spec)
            copy.buffer = None

    # ---- handle death ----------------------------------------------------------------

    def handle_died(self, copy: HostCopy, group: Group | None) -> None:
        """Called from ``Offloaded.__del__``, on any thread (Note [release order], 7).

        ``self.rt.later(self._retire, copy, group)``, inlined: this runs for every
        offloaded tensor, and the lock is free but for a death inside the step's own
        work (or on another thread)."""
        rt = self.rt
        if rt.lock.acquire(blocking=False):
            try:
                if rt.graveyard:
                    rt.drain()
                self._retire(copy, group)
            finally:
                rt.lock.release()
        else:
            rt.graveyard.append((self._retire, copy, group))

    def _retire(self, copy: HostCopy, group: Group | None) -> None:
        copy.refs -= 1
        if copy.refs == 0:
            if copy.buffer is not None:
                self._drop_buffer(copy, reuse=not self.aborted)
            if copy.host is not None:
                if self.recording.binds_blocks and not self.aborted:
                    self.rt.graph_blocks.append(copy.host)  # replays write it
                else:
                    self.rt.pool.free(copy.host)
                copy.host = None
                copy.host_view = None
        if group is not None:
            group.live -= 1
            if group.live == 0:
                if self.trigger.releases_on_death and not group.released and self.forward_done:
                    # manual mode, never released: nothing reads the device bytes any
                    # more; drop them once the copy that reads them is waited for
                    self._release(group)
                self._drop(group)
