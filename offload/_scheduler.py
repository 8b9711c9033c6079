"""The per-forward state machine: which saved tensor goes where, and when.

One :class:`Step` per forward (one entry of the offloader's context). It owns the
groups of that forward (one per layer call), their copies and the handles autograd
holds. Handles outlive the context; the step lives as long as any of them.

Note [release order]
~~~~~~~~~~~~~~~~~~~~
This note is the single place that answers "when is this block freed, and why is it
safe?". Code and tests cite it.

Forward, group g (the call of layer g), offloaded:

1. *Pack.* A saved tensor's byte span is copied into a host block at save time:
   the D2H stream first waits for the current (compute) stream, so the copy starts
   after the kernel that produced the bytes (4.1(a)), and for the pool's H2D fence, so
   the host block is not overwritten while an earlier backward still reads it (4.1(d)).
   The group keeps ``t.detach()`` (the device reference) and the version at pack time.
   Autograd gets a handle, never the tensor itself (a tensor saved by its own producer
   would otherwise form a cycle through its ``grad_fn``).
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
5. *Unpack.* The first unpack of a copy makes the current stream wait for its reload
   event (4.1(c)) and rebuilds the tensor as a view of the reloaded span. A copy that
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

An exception inside the forward (``Step.abort``) waits for the outstanding D2H copies on
the compute stream, drops every device reference and returns every host block at once;
the failed forward's graph can no longer be unpacked.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload import _packing
from offload._device import Backend, backend_for
from offload._host_pool import HostBlock, HostPool
from offload.profiling import LayerStats, OffloadStats

__all__ = ["Plan", "Runtime", "Step", "make_plan", "opted_out"]

_thread = threading.local()


def opted_out() -> bool:
    """Whether the calling thread is inside :func:`offload.no_offload`."""
    return getattr(_thread, "no_offload", 0) > 0


def _enter_no_offload() -> None:
    _thread.no_offload = getattr(_thread, "no_offload", 0) + 1


def _exit_no_offload() -> None:
    _thread.no_offload -= 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors_in(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """Tensors that require grad in a layer's inputs or outputs (tensor, tuple, dict)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif depth < 3:
        if isinstance(obj, (tuple, list)):
            for item in obj:
                _tensors_in(item, out, depth + 1)
        elif isinstance(obj, dict):  # also HF ModelOutput (an OrderedDict)
            for item in obj.values():
                _tensors_in(item, out, depth + 1)
    return out


# --------------------------------------------------------------------------------------
# the plan of one forward


@dataclasses.dataclass(frozen=True)
class Plan:
    """Release and reload points of one forward (DESIGN.md section 3).

    ``release_at[r]`` lists the groups released when layer ``r``'s forward starts (groups
    whose release point is ``L`` are released when the forward ends);
    ``reload_at[q]`` lists the groups reloaded when layer ``q``'s backward starts, in the
    order they will be needed.
    """

    num_groups: int
    offloaded: frozenset[int]
    release_at: dict[int, tuple[int, ...]]
    reload_at: dict[int, tuple[int, ...]]


def make_plan(num_groups: int, offloaded: list[int], prefetch_layers: int | None) -> Plan:
    """The schedule of Note [release order] for ``offloaded`` (sorted) out of ``num_groups``."""
    L, k = num_groups, len(offloaded)
    release: dict[int, list[int]] = collections.defaultdict(list)
    reload: dict[int, list[int]] = collections.defaultdict(list)
    for j, s in enumerate(offloaded):
        r = max(s + 1, L - k + j)
        if r < L:
            release[r].append(s)
        if prefetch_layers is None:
            q = min(L - 1, max(s + 1, L - 1 - k + j))
        else:
            q = min(L - 1, s + prefetch_layers)
        reload[q].append(s)
    return Plan(
        num_groups=L,
        offloaded=frozenset(offloaded),
        release_at={r: tuple(g) for r, g in release.items()},
        reload_at={q: tuple(sorted(g, reverse=True)) for q, g in reload.items()},
    )


# --------------------------------------------------------------------------------------
# copies, groups, handles


class _Copy:
    """One span of one device storage, copied to the host once per forward."""

    __slots__ = (
        "group",
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
        "key",
        "storage_nbytes",
    )

    def __init__(self, group: _Group, start: int, end: int, version: int, host: HostBlock):
        self.group = group  # the group whose D2H event covers this copy
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
        self.key: StorageWeakRef | None = None
        self.storage_nbytes = 0


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
        "live",
        "stats",
        "state_storages",
        "closed",
        "inputs_expected",
        "inputs_seen",
        "times",
    )

    def __init__(self, index: int, module: torch.nn.Module | None, offload: bool, stream: Any):
        self.index = index
        self.module = module
        self.offload = offload
        self.stream = stream  # the compute stream current when the layer ran
        self.copies: dict[int, _Copy] = {}  # id -> copy, also copies made by other groups
        self.device_refs: list[tuple[torch.Tensor, int, _Copy]] = []
        self.d2h_done: Any = None
        self.released = False
        self.reloaded = False
        self.live = 0  # live handles pointing at copies
        self.stats = LayerStats(index=index, offloaded=offload)
        self.state_storages: set[int] | None = None
        self.closed = False
        self.inputs_expected = 0
        self.inputs_seen = 0
        self.times: list[tuple[Any, ...]] | None = None  # timing records (timing=True)


class _Packed:
    """What autograd keeps for one saved tensor: kept on the device, or a host copy.

    ``tensor`` is set for a tensor kept on the device (and, until the next group opens,
    for one saved between two groups); ``copy`` is set once the tensor is offloaded.
    """

    __slots__ = ("step", "group", "copy", "tensor", "version", "dtype", "size", "stride", "offset")

    def __init__(self, step: Step, tensor: torch.Tensor) -> None:
        self.step = step
        self.group: _Group | None = None
        self.copy: _Copy | None = None
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        """The saved tensor: the kept one, or the reloaded copy rebuilt as a view."""
        t = self.tensor
        if t is not None:
            if t._version != self.version:
                raise RuntimeError(_inplace_message(t, self.version))
            return t
        return self.step.unpack_offloaded(self)

    def __del__(self) -> None:
        if self.copy is not None:
            self.step.handle_died(self.copy, self.group)


class _PackedSubclass:
    """A wrapper tensor subclass: its inner tensors are packed one by one."""

    __slots__ = ("cls", "names", "ctx", "parts", "size", "stride")

    def __init__(
        self, cls: type, names: list[str], ctx: Any, parts: list[Any], size: Any, stride: Any
    ):
        self.cls, self.names, self.ctx, self.parts = cls, names, ctx, parts
        self.size, self.stride = size, stride

    def unpack(self) -> torch.Tensor:
        inner = [p.unpack() for p in self.parts]
        return _packing.unflatten(self.cls, self.names, self.ctx, inner, self.size, self.stride)


class _Raw:
    """A non-tensor attribute of a flattened subclass, kept by reference."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unpack(self) -> Any:
        return self.obj


class _PackedQuantized:
    """A TransformerEngine quantized tensor: the object, emptied by
    ``prepare_for_saving()``, and its data/scale tensors packed one by one."""

    __slots__ = ("obj", "parts")

    def __init__(self, obj: Any, parts: list[Any]) -> None:
        self.obj, self.parts = obj, parts

    def unpack(self) -> Any:
        tensors = [None if p is None else p.unpack() for p in self.parts]
        self.obj.restore_from_saved(tensors)  # fills the object in place
        return self.obj


def unpack_hook(handle: _Packed | _PackedSubclass | _PackedQuantized) -> torch.Tensor:
    """The unpack half of the saved-tensor hooks."""
    return handle.unpack()


def _inplace_message(t: torch.Tensor, version: int) -> str:
    return (
        f"one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.dtype}{list(t.shape)}] is at version {t._version}; "
        f"expected version {version} instead (detected by offload: the tensor was saved "
        f"for backward and then changed in place)"
    )


# --------------------------------------------------------------------------------------
# the runtime shared by the forwards of one offloader


class Runtime:
    """State shared by every forward of one offloader: config, pool, backends, lock."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.lock = threading.Lock()
        self._pool: HostPool | None = None
        self._backends: dict[torch.device, Backend] = {}
        self.graveyard: collections.deque[tuple[Step, _Copy, _Group | None]] = collections.deque()
        self.warned_host_limit = False

    @property
    def pool(self) -> HostPool:
        if self._pool is None:
            self._pool = HostPool(self.config.host_memory_limit, self.config.pin_memory)
        return self._pool

    def backend(self, device: torch.device) -> Backend:
        b = self._backends.get(device)
        if b is None:
            b = self._backends[device] = backend_for(device)
        return b

    def drain(self) -> None:
        """Finish the work of handles that died while the lock was busy (lock held)."""
        while self.graveyard:
            step, copy, group = self.graveyard.popleft()
            step._retire(copy, group)

    def close(self) -> None:
        with self.lock:
            self.drain()
            if self._pool is not None:
                self._pool.close()  # the pool can grow again if the offloader is reused


# --------------------------------------------------------------------------------------
# one forward


class Step:
    """The groups, copies and stats of one forward, and the hooks that drive them."""

    def __init__(self, runtime: Runtime, plan: Plan, select: Callable[[int, Any], bool]) -> None:
        self.rt = runtime
        self.cfg = runtime.config
        self.plan = plan
        self.select = select
        self.groups: list[_Group] = []
        self.open: _Group | None = None
        self.depth = 0  # nested calls of registered layers inside an open group
        self.pending: list[tuple[_Packed, torch.Tensor]] = []
        self.forward_done = False
        self.aborted = False
        self.storages: dict[StorageWeakRef, list[_Copy]] = {}
        self.stats = OffloadStats()
        self.device: torch.device | None = None
        self.backend: Backend | None = None
        self.hooks: list[Any] = []
        #: double buffering: reload buffers of finished groups, by size, for later groups
        self.spares: dict[int, list[torch.Tensor]] = {}
        self.stats_double_buffer_reuses = 0

    # ---- forward: layer boundaries ----------------------------------------------------

    def open_group(self, module: torch.nn.Module | None, inputs: Any = None) -> None:
        with self.rt.lock:
            self.rt.drain()
            if self.open is not None:  # a registered layer called inside another one
                self.depth += 1
                return
            index = len(self.groups)
            if index < self.plan.num_groups:
                offload = index in self.plan.offloaded
            else:
                offload = bool(self.select(index, module))
            stream = self.backend.current_stream() if self.backend is not None else None
            group = _Group(index, module, offload, stream)
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
                self._place(handle, t, group)
        if offload and inputs is not None:
            tensors = _tensors_in(inputs, [])
            group.inputs_expected = len(tensors)
            # Plain tensor hooks, not register_multi_grad_hook(mode="all"): that one keeps
            # the inputs' grad_fns in its closure, which the hook registered on those very
            # nodes turns into a reference cycle that keeps the whole graph alive.
            for t in tensors:
                self.hooks.append(t.register_hook(functools.partial(self._input_grad, index)))

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
            if group.device_refs and self.backend is not None:
                group.d2h_done = self.backend.record_d2h()
            index = group.index
        if outputs is not None:
            self.register_trigger(index, outputs)

    def register_trigger(self, index: int, outputs: Any) -> None:
        """Reload the groups due at ``index`` when the gradient of ``outputs`` arrives."""
        if index not in self.plan.reload_at:
            return
        tensors = _tensors_in(outputs, [])
        if tensors:
            self.hooks.append(
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._backward_started, index), mode="any"
                )
            )

    def finish_forward(self) -> None:
        """The context exited normally: release what is left (Note [release order], 3)."""
        with self.rt.lock:
            self.rt.drain()
            self.open = None
            self.forward_done = True
            for _handle, t in self.pending:
                self._keep("outside_layers", None, _span_bytes(t))
            self.pending = []
            for group in self.groups:
                if group.offload and not group.released:
                    if not group.closed and group.device_refs and self.backend is not None:
                        group.d2h_done = self.backend.record_d2h()
                    self._release(group)

    def abort(self) -> None:
        """The forward raised: free everything now (Note [release order], last part)."""
        with self.rt.lock:
            self.rt.drain()
            self.open = None
            self.forward_done = True
            self.aborted = True
            self.pending = []
            if self.backend is not None and any(g.device_refs for g in self.groups):
                done = self.backend.record_d2h()
                for group in self.groups:
                    if group.device_refs:
                        self.backend.wait(group.stream, done)
            for group in self.groups:
                group.device_refs.clear()
                group.released = True
            for copies in self.storages.values():
                for copy in copies:
                    if copy.host is not None:
                        self.rt.pool.free(copy.host)
                        copy.host = None
                    copy.buffer = None
            self.storages.clear()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    # ---- forward: packing ------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> _Packed | _PackedSubclass:
        """The pack half of the saved-tensor hooks (Note [release order], 1)."""
        with self.rt.lock:
            return self._pack(tensor)

    def _pack(self, t: torch.Tensor) -> _Packed | _PackedSubclass | _PackedQuantized:
        marked = (
            opted_out()
            or getattr(t, "_TE_do_not_offload", False)
            or getattr(t, "_do_not_offload", False)
        )
        weight = isinstance(t, torch.nn.Parameter) or getattr(t, "is_weight", False)
        if not marked and not weight and not _packing.is_plain(t):
            if _packing.is_te_quantized(t):
                # TransformerEngine >= 2.0 quantized tensor: prepare_for_saving() empties
                # the object it is called on, so call it on a detached alias, never on
                # the hook's input (4.8).
                tensors, obj = t.detach().prepare_for_saving()
                parts = [None if x is None else self._pack(x) for x in tensors]
                return _PackedQuantized(obj, parts)
            flat = _packing.flatten(t)
            if flat is not None:
                names, ctx, inner = flat
                # inner entries that are not tensors (DTensor's mesh) are kept as they are
                parts = [self._pack(x) if isinstance(x, torch.Tensor) else _Raw(x) for x in inner]
                return _PackedSubclass(type(t), names, ctx, parts, t.size(), t.stride())
        handle = _Packed(self, t.detach())
        if marked:
            self._keep("opted_out", self.open, _span_bytes(t))
        elif weight:
            reason = "parameter" if self.open is not None else "outside_layers"
            self._keep(reason, self.open, _span_bytes(t))
        elif not _packing.is_plain(t) or _packing.unsupported(t):
            self._keep("unsupported", self.open, 0)
        elif self.open is None:
            if self.groups and not self.forward_done:
                self.pending.append((handle, t))  # decided when the next group opens
            else:
                self._keep("outside_layers", None, _span_bytes(t))
        else:
            self._place(handle, t, self.open)
        return handle

    def _keep(self, reason: str, group: _Group | None, nbytes: int) -> None:
        """Count ``nbytes`` kept on the device for ``reason`` (the handle keeps them)."""
        self.stats.bytes_kept[reason] += nbytes
        if group is not None:
            group.stats.bytes_kept[reason] += nbytes

    def _place(self, handle: _Packed, t: torch.Tensor, group: _Group) -> None:
        """Keep ``t`` on the device with a reason, or start its copy to the host."""
        start, end = _packing.span(t)
        nbytes = end - start
        if self.device is None and t.device.type in ("cpu", "cuda"):
            self.device = t.device
            self.backend = self.rt.backend(t.device)
            if group.stream is None:
                group.stream = self.backend.current_stream()
        if t.device != self.device:
            return self._keep("device", group, nbytes)
        if group.state_storages is None:
            group.state_storages = _state_storages(group.module)
        if _packing.is_parameter_derived(t, group.state_storages):
            return self._keep("parameter", group, nbytes)
        if not group.offload:
            return self._keep("not_selected", group, nbytes)
        flt = self.cfg.tensor_filter
        if flt is not None and not flt(t):
            return self._keep("filtered", group, nbytes)
        if nbytes < self.cfg.min_tensor_bytes or nbytes == 0:
            return self._keep("small", group, nbytes)

        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        copies = self.storages.get(key)
        copy = None
        if copies is not None:
            for c in copies:
                if (
                    c.start <= start
                    and end <= c.end
                    and c.version == handle.version
                    and (start - c.start) % t.element_size() == 0
                    and c.host is not None
                ):
                    copy = c
                    break
        if copy is not None and copy.group is not group:
            self._keep("shared", group, nbytes)  # transferred once, by copy.group
        elif copy is None:
            # A view whose span covers at least half of its storage (the chunks of a
            # fused QKV or gate/up projection: each spans almost all of it) takes the
            # whole storage, so its sibling views find their bytes already copied.
            c_start, c_end = start, end
            total = storage.nbytes()
            if 2 * nbytes >= total:
                c_start, c_end = 0, total
            block = self.rt.pool.allocate(c_end - c_start)
            if block is None:
                self._warn_host_limit(c_end - c_start)
                return self._keep("host_limit", group, nbytes)
            copy = _Copy(group, c_start, c_end, handle.version, block)
            copy.key, copy.storage_nbytes = key, total
            self.backend.d2h(
                _packing.as_bytes(t, c_start, c_end),
                block.tensor,
                self.rt.pool.h2d_fence,
                group.times,
            )  # type: ignore[union-attr]
            group.device_refs.append((handle.tensor, handle.version, copy))  # type: ignore[arg-type]  # t.detach()
            self.storages.setdefault(key, []).append(copy)
            sent = c_end - c_start
            group.stats.bytes_offloaded += sent
            self.stats.bytes_offloaded += sent
            name = _dtype_name(t.dtype)
            self.stats.bytes_by_dtype[name] = self.stats.bytes_by_dtype.get(name, 0) + sent
        if id(copy) not in group.copies:
            group.copies[id(copy)] = copy
            copy.users += 1
        copy.refs += 1
        group.live += 1
        handle.group = group
        handle.copy = copy
        handle.dtype = t.dtype
        handle.size = t.size()
        handle.stride = t.stride()
        handle.offset = start - copy.start
        handle.tensor = None

    def _warn_host_limit(self, nbytes: int) -> None:
        if not self.rt.warned_host_limit:
            self.rt.warned_host_limit = True
            pool = self.rt.pool
            warnings.warn(
                f"offload: the host memory budget is reached ({pool.reserved_bytes} of "
                f"host_memory_limit={pool.limit} bytes reserved; a tensor of {nbytes} bytes "
                f"stays on the device, reason 'host_limit'). Raise host_memory_limit to "
                f"offload more; training stays correct.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _release(self, group: _Group) -> None:
        """Drop a group's device references once its copies are done (lock held)."""
        if group.released:
            return
        group.released = True
        if not group.device_refs:
            return
        self.backend.wait(group.stream, group.d2h_done, group.times)  # type: ignore[union-attr]
        mine = set()
        for t, version, copy in group.device_refs:
            if t._version != version:
                copy.poison = _inplace_message(t, version)
            mine.add(copy.key)
        del t  # the loop variable would keep the last tensor alive
        group.device_refs.clear()
        # Storages whose last reference was ours are free now: that is the device memory
        # this release gave back (a storage that another group or the caller still holds
        # travelled for nothing, and is not counted).
        freed = sum(
            copies[0].storage_nbytes
            for key in mine
            if key.expired() and (copies := self.storages.get(key))
        )
        group.stats.bytes_released += freed
        self.stats.bytes_released += freed

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
        pairs, waits, todo = [], [], []
        for copy in group.copies.values():
            if copy.buffer is None and copy.host is not None:
                copy.buffer = self._reload_buffer(copy.end - copy.start, stream)
                pairs.append((copy.host.tensor, copy.buffer))
                owner = copy.group
                if owner.d2h_done is None and owner.device_refs:
                    owner.d2h_done = backend.record_d2h()  # type: ignore[union-attr]
                waits.append(owner.d2h_done)
                todo.append(copy)
        if pairs:
            event = backend.h2d(pairs, waits, stream, group.times)  # type: ignore[union-attr]
            for copy in todo:
                copy.reload_event = event
                copy.stream = stream
                copy.waited = False
                copy.holders = copy.users  # kept until every user group is done
                self.stats.bytes_reloaded += copy.end - copy.start
            if event is not None:
                self.rt.pool.h2d_fence = event
        group.reloaded = True

    def _reload_buffer(self, nbytes: int, stream: Any) -> torch.Tensor:
        """A device buffer for a reload: a spare one of this size when double buffering
        and nothing references it any more, else a fresh one from the compute stream's
        pool. Reuse is safe in stream order: the H2D that refills it waits for the
        compute stream, behind every kernel that read the previous contents."""
        spares = self.spares.get(nbytes)
        while spares:
            buf = spares.pop()
            if _storage_use_count(buf) <= 2:  # our tensor (+ the storage's Python wrapper)
                self.stats_double_buffer_reuses += 1
                return buf
        return self.backend.alloc(nbytes, stream)  # type: ignore[union-attr]

    def unpack_offloaded(self, handle: _Packed) -> torch.Tensor:
        """Rebuild an offloaded tensor (Note [release order], 5)."""
        with self.rt.lock:
            self.rt.drain()
            copy = handle.copy
            if copy.poison is not None:  # type: ignore[union-attr]
                raise RuntimeError(copy.poison)  # type: ignore[union-attr]
            if copy.host is None:  # type: ignore[union-attr]
                raise RuntimeError(
                    "offload: this saved tensor's host copy was freed because the forward "
                    "that saved it raised an exception; run the forward again before "
                    "calling backward"
                )
            if copy.buffer is None:  # type: ignore[union-attr]
                self._reload(handle.group)  # type: ignore[arg-type]  # on demand
            if not copy.waited:  # type: ignore[union-attr]
                self.backend.wait_current(copy.reload_event, handle.group.times)  # type: ignore[union-attr]
                copy.waited = True  # type: ignore[union-attr]
            buffer = copy.buffer  # type: ignore[union-attr]
        return _packing.rebuild(buffer, handle.dtype, handle.size, handle.stride, handle.offset)

    def _drop(self, group: _Group) -> None:
        """A group's backward is over: give up its reloaded buffers (lock held)."""
        if not group.reloaded:
            return
        group.reloaded = False
        for copy in group.copies.values():
            copy.holders -= 1
            if copy.holders <= 0:
                copy.holders = 0
                self._drop_buffer(copy, reuse=self.cfg.double_buffering)
        if self.spares and group.index == min(self.plan.offloaded, default=0):
            self.spares.clear()  # the backward of this forward is over: no more reloads

    def _drop_buffer(self, copy: _Copy, reuse: bool = False) -> None:
        if copy.buffer is not None:
            if not copy.waited:
                self.backend.wait(copy.stream, copy.reload_event)  # type: ignore[union-attr]
            if reuse:
                self.spares.setdefault(copy.buffer.numel(), []).append(copy.buffer)
            copy.buffer = None

    # ---- handle death ----------------------------------------------------------------

    def handle_died(self, copy: _Copy, group: _Group | None) -> None:
        """Called from ``_Packed.__del__``, on any thread (Note [release order], 7)."""
        rt = self.rt
        if rt.lock.acquire(blocking=False):
            try:
                rt.drain()
                self._retire(copy, group)
            finally:
                rt.lock.release()
        else:
            rt.graveyard.append((self, copy, group))

    def _retire(self, copy: _Copy, group: _Group | None) -> None:
        copy.refs -= 1
        if copy.refs == 0:
            self._drop_buffer(copy, reuse=self.cfg.double_buffering and not self.aborted)
            if copy.host is not None:
                self.rt.pool.free(copy.host)
                copy.host = None
        if group is not None:
            group.live -= 1
            if group.live == 0:
                self._drop(group)

    def read_stats(self) -> OffloadStats:
        """The stats, brought up to date: deaths queued by other threads are processed,
        the pool figures refreshed and, with ``timing=True``, the copy times resolved
        (which waits on the host for the recorded copies)."""
        with self.rt.lock:
            self.rt.drain()
            pool = self.rt._pool
            if pool is not None:
                self.stats.host_pool_bytes = pool.in_use_bytes
                self.stats.host_pool_reserved_bytes = pool.reserved_bytes
                self.stats.host_pool_peak_bytes = pool.peak_bytes
        if self.cfg.timing:
            self._resolve_timings()
        return self.stats

    def _resolve_timings(self) -> None:
        """Fill the layers' ``d2h_seconds``/``h2d_seconds``/``stall_seconds`` from the
        timing records (``timing=True``). Waits on the host for the recorded copies."""
        with self.rt.lock:
            records = [(g, list(g.times)) for g in self.groups if g.times is not None]
        for group, times in records:
            sums = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0}
            for record in times:
                if len(record) == 2:  # measured on the host (synchronous path)
                    sums[record[0]] += record[1]
                else:
                    kind, start, end = record
                    end.synchronize()
                    sums[kind] += start.elapsed_time(end) / 1e3
            group.stats.d2h_seconds = sums["d2h"]
            group.stats.h2d_seconds = sums["h2d"]
            group.stats.stall_seconds = sums["stall"]


def _span_bytes(t: torch.Tensor) -> int:
    start, end = _packing.span(t)
    return end - start


def _storage_use_count(t: torch.Tensor) -> int:
    # No public API tells whether anything else still references a storage (an output
    # that is a view of a reloaded tensor, a user reference); this private one does.
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _state_storages(module: torch.nn.Module | None) -> set[int]:
    if module is None:
        return set()
    out = set()
    for t in (*module.parameters(), *module.buffers()):
        if not _packing.is_plain(t):  # DTensor (FSDP2 sharded, TP): its local shard
            t = getattr(t, "_local_tensor", None)
            if t is None:
                continue
        out.add(t.untyped_storage().data_ptr())
    out.discard(0)
    return out
