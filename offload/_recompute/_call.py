"""One checkpointed call (Note [checkpoint inputs] in ``_checkpoint.py``): its tensor
arguments kept or copied to host blocks, released after the forward, reloaded (ahead of
time or on demand) for the recomputation, and rebuilt as views of the reloaded bytes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _python_dispatch

import offload.activations._placement as _placement
from offload._core import _packing
from offload._core._device import Backend
from offload._core._host_pool import HostBlock
from offload._core._kept import inplace_message
from offload._core._pytree import join, split
from offload._core._transfer import HostCopy

if TYPE_CHECKING:
    from offload._recompute._checkpoint import CheckpointRuntime

__all__ = ["Record", "backward_started", "flatten", "grad_tensors", "release", "stash"]

#: how deep outputs are searched for tensors that require grad
_MAX_DEPTH = 8

_kept_bytes = _placement.kept_bytes


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[torch.Tensor]]:
    """The tensors of a call's arguments (positional, keyword, and nested in pytree
    containers) and a spec that :func:`unflatten` fills with new tensors."""
    return split((args, kwargs))


unflatten = join


def grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Non-leaf tensors that require grad in a call's output (tensor, tuple, list,
    dict). A leaf can only be an input handed back: a hook on it would outlive the graph
    (a parameter's hooks pile up step after step)."""
    found = _packing.tensors_requiring_grad(obj, [], max_depth=_MAX_DEPTH)
    return [t for t in found if t.grad_fn is not None]


class _CallCopy(HostCopy):
    """A host copy shared by the live calls that use it; its death returns the block
    to the pool (Note [checkpoint inputs], 6)."""

    __slots__ = ("rt", "__weakref__")

    def __init__(
        self,
        rt: CheckpointRuntime,
        block: HostBlock,
        start: int,
        end: int,
        version: int,
        storage: torch.UntypedStorage,
    ) -> None:
        super().__init__(-1, start, end, version, block, None, storage)
        self.rt = rt

    def __del__(self) -> None:
        block, self.host = getattr(self, "host", None), None  # None: never initialised
        if block is not None:
            rt = self.rt
            rt.later(rt.free, block)


class _Arg:
    """An offloaded argument: which copy holds its bytes and how to rebuild it."""

    __slots__ = ("copy", "offset", "dtype", "size", "stride", "requires_grad", "version")

    def __init__(self, copy: HostCopy, offset: int, t: torch.Tensor) -> None:
        self.copy = copy
        self.offset = offset  # bytes from the start of the copy
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.requires_grad = t.requires_grad
        self.version = t._version


class Record:
    """One checkpointed call: the function, the argument structure, the host copies.

    Torch's checkpoint frame holds it as the checkpointed function (``__call__``), so it
    lives exactly as long as the graph that can recompute the call. It holds no device
    input after the forward (Note [checkpoint inputs], 3).
    """

    __slots__ = (
        "rt",
        "function",
        "spec",
        "slots",
        "copies",
        "device",
        "backend",
        "stream",
        "forward_call",
        "d2h_event",
        "buffers",
        "reload_event",
        "waited",
        "poison",
        "aborted",
        "prev",
        "__weakref__",
    )

    def __init__(self, rt: CheckpointRuntime, function: Callable[..., Any], spec: Any) -> None:
        self.rt = rt
        self.function = function
        self.spec = spec
        self.slots: list[_Arg | None] = []  # None: passed to torch (kept)
        self.copies: list[HostCopy] = []  # unique, in slot order
        self.device: torch.device | None = None
        self.backend: Backend | None = None
        self.stream: Any = None  # the compute stream of the forward
        self.forward_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.d2h_event: Any = None
        self.buffers: dict[int, torch.Tensor] | None = None  # id(copy) -> device bytes
        self.reload_event: Any = None
        self.waited = False
        self.poison: str | None = None
        self.aborted = False
        self.prev: weakref.ref[Record] | None = None

    # called by torch.utils.checkpoint: once in the forward, again for each recompute
    def __call__(self, *torch_args: Any) -> Any:
        call = self.forward_call
        if call is not None:  # the forward: the caller's own objects
            return self.function(*call[0], **call[1])
        # Our copies and views are not part of the recomputation: hide them from any
        # dispatch mode the recomputation runs under (selective checkpointing's cache,
        # debug=True's operator trace)
        with _no_dispatch_modes():
            leaves = self._recompute_leaves(torch_args)
        args, kwargs = unflatten(self.spec, leaves)
        return self.function(*args, **kwargs)

    def _recompute_leaves(self, torch_args: tuple[Any, ...]) -> list[torch.Tensor]:
        rt = self.rt
        with rt.lock:
            rt.drain()
            if self.aborted:
                raise RuntimeError(
                    "offload.checkpoint: the forward of this checkpointed call raised an "
                    "exception and its inputs' host copies were freed; run the forward "
                    "again before calling backward"
                )
            if self.poison is not None:
                raise RuntimeError(self.poison)
            if self.copies:
                if self.buffers is None:
                    self._reload()
                    rt.stats.reloads_on_demand += 1
                if not self.waited:
                    self.backend.wait_current(self.reload_event)  # type: ignore[union-attr]
                    self.waited = True
            buffers, self.buffers = self.buffers, None  # the rebuilt tensors own them now
        leaves: list[torch.Tensor] = []
        for i, slot in enumerate(self.slots):
            if slot is None:
                leaves.append(torch_args[i])
                continue
            buf = buffers[id(slot.copy)]  # type: ignore[index]
            t = _packing.rebuild(buf, slot.dtype, slot.size, slot.stride, slot.offset)
            if slot.requires_grad:
                t.requires_grad_(True)
            leaves.append(t)
        return leaves

    def _reload(self) -> None:
        """Start the H2D copies of every host copy (lock held; Note, 4 and 5)."""
        backend = self.backend
        stream = self.stream if self.stream is not None else backend.current_stream()  # type: ignore[union-attr]
        pairs, waits, buffers = [], [], {}
        allocated = backend.alloc([c.nbytes for c in self.copies], stream)  # type: ignore[union-attr]
        for copy, buf in zip(self.copies, allocated):
            buffers[id(copy)] = buf
            pairs.append((copy.host.tensor, buf, None))  # type: ignore[union-attr]
            waits.append(copy.d2h_event)
        event = backend.h2d(pairs, waits, stream)  # type: ignore[union-attr]
        self.buffers = buffers
        self.reload_event = event
        self.waited = False
        if event is not None:
            self.rt.pool.h2d_fence = event
        self.rt.stats.bytes_reloaded += sum(c.nbytes for c in self.copies)

    def prefetchable(self) -> bool:
        return bool(self.copies) and self.buffers is None and not self.aborted

    def abort(self) -> None:
        """The forward raised: wait for the copies, free the host blocks (Note, end)."""
        self.aborted = True
        self.forward_call = None
        if self.copies and self.backend is not None:
            # 4.1(b): the device inputs may be freed only after their copies read them
            # (``_stash`` may have stopped before recording the event: record one now)
            event = self.d2h_event if self.d2h_event is not None else self.backend.record_d2h()
            self.backend.wait_current(event)
        self.slots = []
        self.copies = []  # the blocks go back to the pool with the last reference

    def __del__(self) -> None:
        buffers = getattr(self, "buffers", None)  # None also when never initialised
        if buffers is not None and not self.waited and self.backend is not None:
            # 4.1(e): the block returns to the allocator only after the H2D writing it
            self.backend.wait(self.stream, self.reload_event)


def _no_dispatch_modes() -> Any:
    disable = getattr(_python_dispatch, "_disable_current_modes", None)
    return disable() if disable is not None else contextlib.nullcontext()


def stash(
    rt: CheckpointRuntime, record: Record, leaves: list[torch.Tensor], min_bytes: int
) -> list[Any]:
    """Keep or copy each tensor argument (Note [checkpoint inputs], 1); returns the
    arguments torch gets: kept tensors and placeholders."""
    kept = rt.stats.bytes_kept
    # the call's device: that of its first CPU/CUDA tensor (CUDA first)
    device = None
    for t in leaves:
        if t.device.type == "cuda":
            device = t.device
            break
    if device is None:
        for t in leaves:
            if t.device.type == "cpu":
                device = t.device
                break
    torch_args: list[Any] = list(leaves)
    record.slots = [None] * len(leaves)
    if device is None:
        for t in leaves:
            kept["device"] += _kept_bytes(t)
        return torch_args
    # 1. which tensors travel; group them by storage
    chosen: dict[int, list[tuple[int, torch.Tensor, int, int]]] = {}
    for i, t in enumerate(leaves):
        reason = None
        if not _packing.is_plain(t) or _packing.unsupported(t):
            reason = "unsupported"
        elif _placement.marked(t):
            reason = "opted_out"
        elif issubclass(type(t), torch.nn.Parameter):
            reason = "parameter"
        elif t.device != device:
            reason = "device"
        if reason is None:
            start, end = _packing.span(t)
            if end - start == 0 or end - start < min_bytes:
                reason = "small"
        if reason is not None:
            kept[reason] += _kept_bytes(t)
            continue
        key = t.untyped_storage()._cdata
        chosen.setdefault(key, []).append((i, t, start, end))
    if not chosen:
        return torch_args
    record.device = device
    backend = record.backend = rt.backend(device)
    record.stream = backend.current_stream()
    new_copies: list[_CallCopy] = []
    with rt.lock:
        rt.drain()
        pool = rt.pool
        for key, items in chosen.items():
            storage = items[0][1].untyped_storage()
            version = items[0][1]._version
            for start, end, members in _merge_spans(items):
                copy = rt.shared.get((key, start, end))
                if (
                    copy is not None
                    and copy.version == version
                    and copy.host is not None
                    and copy.ref is not None
                    and not copy.ref.expired()
                ):
                    rt.stats.bytes_shared += end - start
                else:
                    block = pool.allocate(end - start)
                    if block is None:
                        rt.warn_host_limit(end - start, "an input")
                        for _, t in members:
                            kept["host_limit"] += _kept_bytes(t)
                        continue
                    copy = _CallCopy(rt, block, start, end, version, storage)
                    backend.d2h(
                        [(_packing.as_bytes(members[0][1], start, end), block.tensor, None)],
                        pool.h2d_fence,
                    )
                    rt.shared[(key, start, end)] = copy
                    rt.stats.bytes_offloaded += end - start
                    new_copies.append(copy)
                if not any(c is copy for c in record.copies):
                    record.copies.append(copy)
                for i, t in members:
                    record.slots[i] = _Arg(copy, _span_start(t) - copy.start, t)
                    torch_args[i] = rt.placeholder(device)
                    rt.stats.tensors_offloaded += 1
        if new_copies:
            # one event after this call's copies: the reloads wait for it, the
            # compute stream waits for it before the inputs may be freed
            record.d2h_event = backend.record_d2h()
            for copy in new_copies:
                copy.d2h_event = record.d2h_event
        if record.copies:
            rt.stats.calls += 1
    return torch_args


def release(record: Record, leaves: list[torch.Tensor]) -> None:
    """The forward is over (Note [checkpoint inputs], 3): make the compute stream
    wait for the D2H copies; check versions. The caller then drops the references."""
    if record.d2h_event is not None:
        record.backend.wait_current(record.d2h_event)  # type: ignore[union-attr]
    for slot, t in zip(record.slots, leaves):
        if slot is not None and t._version != slot.version:
            record.poison = inplace_message(t, slot.version)
            break


def _span_start(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def _merge_spans(
    items: list[tuple[int, torch.Tensor, int, int]],
) -> list[tuple[int, int, list[tuple[int, torch.Tensor]]]]:
    """Group the tensors of one storage into copies: spans that overlap or touch are
    copied once; a tensor whose offset in a merged span is not a multiple of its item
    size gets a copy of its own."""
    items = sorted(items, key=lambda it: (it[2], it[3]))
    groups: list[list[Any]] = []  # [start, end, members]
    for i, t, start, end in items:
        if groups and start <= groups[-1][1]:
            g = groups[-1]
            g[1] = max(g[1], end)
            g[2].append((i, t, start))
        else:
            groups.append([start, end, [(i, t, start)]])
    out: list[tuple[int, int, list[tuple[int, torch.Tensor]]]] = []
    for g_start, g_end, members in groups:
        aligned = [(i, t) for i, t, s in members if (s - g_start) % t.element_size() == 0]
        out.append((g_start, g_end, aligned))
        for i, t, s in members:
            if (s - g_start) % t.element_size():
                s2, e2 = _packing.span(t)
                out.append((s2, e2, [(i, t)]))
    return out


def backward_started(ref: weakref.ref[Record], depth: int, _grad: Any) -> None:
    """The first gradient of a call's outputs arrived: reload its own inputs if no
    earlier backward did (needed first, so copied first), then prefetch the calls before
    it."""
    record = ref()
    if record is None:
        return
    rt = record.rt
    with rt.lock:
        rt.drain()
        if record.prefetchable():
            record._reload()
            rt.stats.reloads_on_demand += 1
        prev = record.prev
        for _ in range(depth):
            target = prev() if prev is not None else None
            if target is None:
                break
            if target.prefetchable():
                target._reload()
                rt.stats.reloads_prefetched += 1
            prev = target.prev
