"""Where each saved tensor of a forward goes: pack -> place -> dedupe -> bucket -> D2H.

The hot path of the pack hook (Note [release order] in ``_step.py``, steps 1, 1(b) and
1(c)): keep a tensor with a reason, or find or make the host copy of its bytes, and
queue and issue the D2H copies in batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch._utils import _flatten_dense_tensors
from torch.multiprocessing.reductions import StorageWeakRef

import offload.activations._placement as _placement
from offload._core import _compress, _dynamo, _packing
from offload._core._host_pool import HostBlock
from offload._core._runtime import thread_state
from offload._core._transfer import HostCopy
from offload.activations._group import ManualPhase
from offload.activations._handles import (
    Gathered,
    Kept,
    Offloaded,
    PackedQuantized,
    PackedSubclass,
    Pending,
    Raw,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from offload._core._runtime import Runtime
    from offload.activations._group import Group
    from offload.activations._policy import Recording
    from offload.config import OffloadConfig
    from offload.stats import OffloadStats

__all__ = ["Saves"]

_nbytes = _placement.kept_bytes
_SAVED = ManualPhase.SAVED

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
#: instead of getting a host block and a copy each way of its own: below about a MiB a
#: tensor's link time is no more than the host time of a copy of its own (allocating,
#: issuing and later reloading it), which then paces small layers.
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
_CHAIN_NODES = _packing.CHAIN_NODES
_derives = _packing.derives_from_parameter


def _base_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte span of ``t``'s base when ``offload.start_offload(...,
    offload_base_tensor=True)`` marked the view ``t`` (TransformerEngine's attribute)."""
    d = t.__dict__
    if d and d.get("offload_base_tensor"):
        base = t._base
        if base is not None:
            return _packing.span(base)
    return None


class _Bucket(HostCopy):
    """The small tensors of one layer call and one dtype that travel together (Note
    [release order], 1(b)): one host block, one D2H and one H2D copy. Its members are
    numbered in saving order; ``Step.storages`` lists ``(bucket, i)`` under member
    ``i``'s device storage, so that saving that storage again finds it.

    Until its seal the bucket's span ``[0, end)`` counts the elements it can hold; then
    ``end`` is its bytes and ``spec`` its flat geometry, like any copy's."""

    __slots__ = (
        "dtype",
        "fill",
        "offsets",
        "poisons",
        "sources",
        "versions",
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


if TYPE_CHECKING:

    class _SavesState:
        """The state of the Step that :class:`Saves` is a part of, for the type checker."""

        rt: Runtime
        cfg: OffloadConfig
        groups: list[Group]
        open: Group | None
        pending: list[tuple[Pending, torch.Tensor]]
        forward_done: bool
        storages: dict[int, list[Any]]  # copies, and (bucket, member index) pairs
        buckets: dict[torch.dtype, _Bucket]
        all_buckets: list[_Bucket]
        stats: OffloadStats
        outside: dict[str, int]
        device: torch.device | None
        backend: Any
        counts: bool
        watch: Any
        d2h_queue: list[tuple[torch.Tensor, torch.Tensor, torch.dtype | None]]
        d2h_transient: list[torch.Tensor]
        compress: bool
        tensor_filter: Callable[[torch.Tensor], bool] | None
        min_tensor_bytes: int
        recording: Recording
        holds_saves: bool
        gathering: bool
        _hold: Callable[..., Any]
        reloaded_buffer: Callable[..., torch.Tensor]
        handle_died: Callable[..., None]

else:
    _SavesState = object


class Saves(_SavesState):
    """The placement of a forward's saves (a part of :class:`offload.activations._step.Step`,
    whose state it uses)."""

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
        elif not group.offload and not self.counts:
            group.stats.bytes_kept["not_selected"] += _nbytes(t)
            return Kept(t)
        with self.rt.lock:
            return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Any:
        group = self.open
        d = t.__dict__
        if thread_state.no_offload > 0 or (  # opted_out(), _placement.marked(t)
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

    def _place_deferred(self, group: Group) -> None:
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

    def _keep(self, reason: str, group: Group | None, t: torch.Tensor) -> Kept:
        """Keep ``t`` on the device, counted under ``reason``."""
        kept = group.stats.bytes_kept if group is not None else self.outside
        kept[reason] += _nbytes(t)
        return Kept(t)

    def _place(self, t: torch.Tensor, group: Group, version: int | None = None) -> Kept | Offloaded:
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
        state = group.layer
        if state is None:
            state = group.layer = _placement.layer_state(group.module)
        storage = t.untyped_storage()
        # _placement.parameter_like, inlined (_pack kept the Parameters already)
        storages, frozen = state.storages, state.frozen_shapes
        fn = t.grad_fn  # a compute node (the usual case) is no view or cast of a parameter
        if (
            storage.data_ptr() in storages
            or (fn is not None and type(fn).__name__ in _CHAIN_NODES and _derives(fn, storages))
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
        if self.holds_saves and group.phase is _SAVED:
            # the held alias will have no _base: take the base's span now
            return self._hold(t, group, start, end, _base_span(t))
        return self._copy(t, group, storage, start, end, None, contiguous, version)

    def _copy(
        self,
        t: torch.Tensor,
        group: Group,
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
                self.rt.warn_host_limit(sent)
                return self._keep("host_limit", group, t)
            copy = HostCopy(group.index, c_start, c_end, version, block, codec, storage, total)
            alias = t.detach()  # same storage and version counter (the device reference)
            if codec is None and start == 0 and end == total and t.is_contiguous():
                # The tensor's elements are exactly its storage's bytes: copy it into a
                # host view of its own dtype and geometry (same bytes, same places), which
                # saves a byte view of each side (HostCopy.spec).
                copy.spec = (dtype, size, stride)
                copy.host_view = view = block.typed(dtype, size, stride)
                pair = (alias, view, None)
                whole = True
            else:
                copy.host_view = view = block.typed(torch.uint8, (sent,), (1,))
                pair = (_packing.as_bytes(t, c_start, c_end), view, codec)
            versions = group.input_versions
            early = versions is not None and versions.get(key) == version
            self._queue_d2h(pair, group, sent, group.input_mark if early else None)
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
        group: Group,
        key: int,
        copies: list[HostCopy | tuple[_Bucket, int]] | None,
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
        self, bucket: _Bucket | None, numel: int, group: Group, dtype: torch.dtype
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
        self,
        pair: tuple[torch.Tensor, torch.Tensor, torch.dtype | None],
        group: Group,
        sent: int,
        ready: Any = None,
    ) -> None:
        """Queue one D2H copy of ``sent`` bytes for ``group``, and issue the queue when
        it holds a batch or this copy is large (Note [release order], 1; lock held).
        ``ready``: a mark after which the source is complete (one of the call's inputs,
        1(d)): the copy is issued at once, waiting only for it."""
        if ready is not None:
            self._flush_d2h(group, seal=False)  # the queued copies keep their own wait
            self.d2h_queue.append(pair)
            self._flush_d2h(group, seal=False, ready=ready)
            return
        self.d2h_queue.append(pair)
        if len(self.d2h_queue) >= _D2H_BATCH or sent >= _D2H_EAGER_BYTES:
            self._flush_d2h(group, seal=False)

    def _count_sent(
        self, group: Group, dtype: torch.dtype, sent: int, before: int | None = None
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

    def _codec(self, t: torch.Tensor, start: int, end: int) -> torch.dtype | None:
        """The dtype to quantize the span ``[start, end)`` of ``t``'s storage from
        (``compress="fp8"``), or ``None`` to send its bytes exactly: integer, bool and
        fp8 tensors, spans that are not whole elements of ``t``'s dtype, and tensors
        ``compress_filter`` exempts; without a filter, fp32 tensors (in mixed precision
        the softmax and norm statistics: a large share of the gradient error for a
        small share of the bytes)."""
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

    def _flush_d2h(self, group: Group | None, seal: bool = True, ready: Any = None) -> None:
        """Issue the queued D2H copies, those of the open buckets first unless ``seal``
        is false (lock held). Sealing also places ``group``'s held-back saves first
        (Note [release order], 1(c)). ``ready``: the mark the copies wait for (default:
        :attr:`d2h_ready`, else everything queued so far)."""
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
            fence = self.rt.pool.h2d_fence if self.recording.fenced else None
            if ready is None and not transient:  # with a flat copy (transient): a mark of now
                ready = self.d2h_ready
            self.backend.d2h(queue, fence, times, transient, ready)

    def _issue(self, group: Group) -> None:
        """Place ``group``'s held-back saves, issue its copies and record the D2H event
        that covers them (Note [release order], 1-2; lock held)."""
        self._flush_d2h(group)
        if group.device_refs and self.backend is not None:
            group.d2h_done = self.backend.record_d2h()


_dynamo.opaque(Saves.pack)  # the pack hook: never a frame for dynamo (offload/_core/_dynamo.py)
