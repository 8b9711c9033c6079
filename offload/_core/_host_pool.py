"""Host memory for offloaded bytes: large slabs, sub-allocated best-fit, reused.

One :class:`HostPool` per offloader. It asks the system for memory only in slabs whose
size is a power of two (PyTorch's caching host allocator rounds every pinned block up
to a power of two, so any other size would pin memory that goes unused and would make
``reserved_bytes`` lie). Inside a slab, blocks are carved best-fit from a free list
aligned to :data:`ALIGN` bytes and merged with their neighbours when freed, so a step
whose shapes differ from the last one reuses the same slabs instead of growing the
pool: after every step all blocks return, the free lists collapse to whole slabs, and
the next step fits in them unless it needs more bytes at once than any earlier one.

Slabs grow with the pool (``ahead``): a new slab holds at least a quarter of what is
reserved, up to :data:`MAX_AHEAD_SLAB`. Without that, the first steps' tensors set the
slab size, and a later step whose tensors are larger (a longer sequence) finds no free
range to hold them in slabs that are mostly empty: it pins new memory in the middle of
its forward, which costs far more than the step (pinning runs at a few GB/s). With it,
most bytes sit in large slabs, at most about a quarter more than ever needed at once.

The budget (``limit``) bounds the bytes reserved. A request that does not fit is
refused (``allocate`` returns ``None``); the caller keeps the tensor on the device.
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
from typing import Any

import torch

__all__ = [
    "ALIGN",
    "MAX_AHEAD_SLAB",
    "MAX_CACHED_VIEWS",
    "MIN_SLAB_BYTES",
    "HostBlock",
    "HostPool",
    "default_host_limit",
]

#: Alignment of every block (bytes): enough for every dtype and for fast DMA.
ALIGN = 512
#: Smallest slab the pool asks for.
MIN_SLAB_BYTES = 64 << 20
#: Largest slab asked for ahead of a request (module docstring).
MAX_AHEAD_SLAB = 1 << 30
#: Most typed views a slab caches (:meth:`HostBlock.typed`); the cache is emptied when
#: full (shapes that change every step would otherwise grow it without end).
MAX_CACHED_VIEWS = 8192


#: Pinned bytes past which the pool says once that pinning slows the first steps.
PINNING_NOTE_BYTES = 8 << 30
_PINNING_NOTE = (
    "offload: pinning more than {gib:.0f} GiB of host memory for the saves being offloaded "
    "(one-time: page-locking runs at a few GB/s, so the first steps are slower than later ones)"
)


def default_host_limit() -> int:
    """Half of the available host memory, divided by ``LOCAL_WORLD_SIZE`` (torchrun)."""
    import psutil

    world = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        local = max(1, int(world))
    except ValueError:
        local = 1
    return int(psutil.virtual_memory().available // 2 // local)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Slab:
    __slots__ = ("buffer", "size", "order", "starts", "sizes", "used", "typed", "views")

    def __init__(self, buffer: torch.Tensor, order: int) -> None:
        self.buffer = buffer
        self.size = buffer.numel()
        self.order = order  # creation order: ties of best fit go to the oldest slab
        #: dtype -> the whole slab viewed as that dtype (made at first use; the size is
        #: a power of two of at least ALIGN bytes, so every itemsize divides it)
        self.typed: dict[torch.dtype, torch.Tensor] = {}
        #: (start, dtype, size, stride) -> that view of the slab (HostBlock.typed): a
        #: step whose shapes repeat the last one's gets its blocks at the same starts
        self.views: dict[tuple[int, torch.dtype, Any, Any], torch.Tensor] = {}
        self.starts: list[int] = [0]  # free ranges, sorted by start
        self.sizes: list[int] = [self.size]
        self.used = 0


class HostBlock:
    """A block of host bytes owned by one offloaded span until :meth:`HostPool.free`.

    Its ``tensor`` (a ``uint8`` view of its ``length`` bytes) is made at first use: the
    activation offloader copies through :meth:`typed` views instead (cached by the
    slab). After :meth:`HostPool.free` it is ``None``."""

    __slots__ = ("slab", "start", "nbytes", "length", "_tensor")

    def __init__(self, slab: _Slab, start: int, nbytes: int, length: int) -> None:
        self.slab: _Slab | None = slab
        self.start = start
        self.nbytes = nbytes  # reserved (aligned) bytes
        self.length = length  # requested bytes
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        t = self._tensor
        if t is None:
            slab = self.slab
            if slab is None:  # freed
                return None
            t = self._tensor = slab.buffer[self.start : self.start + self.length]
        return t

    def typed(self, dtype: torch.dtype, size: Any, stride: Any) -> torch.Tensor:
        """A tensor of ``dtype``, ``size`` and ``stride`` over the block's first bytes
        (its start is ALIGN-aligned, a multiple of every itemsize). The caller keeps
        it within ``length`` bytes, and never changes the tensor's metadata: the view
        is cached in the slab and handed out again to the next block of the same start
        and geometry (making one costs more than the rest of a block's allocation)."""
        slab: _Slab = self.slab  # type: ignore[assignment]
        views = slab.views
        key = (self.start, dtype, size, stride)
        view = views.get(key)
        if view is None:
            whole = slab.typed.get(dtype)
            if whole is None:
                whole = slab.typed[dtype] = slab.buffer.view(dtype)
            view = whole.as_strided(size, stride, self.start // dtype.itemsize)
            if len(views) >= MAX_CACHED_VIEWS:
                views.clear()
            views[key] = view
        return view


class HostPool:
    """Slabs of (pinned) host memory, sub-allocated best-fit, with a byte budget.

    Args:
        limit: most bytes the pool may reserve. ``None`` uses :func:`default_host_limit`.
        pin: page-lock the slabs (only meaningful with an accelerator).
        min_slab: smallest slab asked for (rounded up to a power of two). Default
            ``None``: :data:`MIN_SLAB_BYTES` (the weight offloader passes a larger one, so
            that many weights share a slab).
        retain: never give a slab back before :meth:`close` (``True``: host addresses
            stay valid across steps, e.g. for CUDA graphs; a request that only fits by
            returning empty slabs is refused instead). Default ``False``: when over
            budget, empty slabs too small for a request are returned first.
        ahead: a new slab holds at least a quarter of the bytes reserved (up to
            :data:`MAX_AHEAD_SLAB`; module docstring). Default ``True``; the weight
            offloader, which knows its bytes up front, passes ``False``.

    Invariants: ``in_use_bytes <= reserved_bytes <= limit``; a block is handed out to one
    owner at a time; ``close()`` returns every slab to the system.
    """

    def __init__(
        self,
        limit: int | None,
        pin: bool,
        min_slab: int | None = None,
        retain: bool = False,
        ahead: bool = True,
    ) -> None:
        self.limit = default_host_limit() if limit is None else int(limit)
        self._said_pinning = False
        self.pin = pin
        self.retain = retain
        self.ahead = ahead
        self.min_slab = None if min_slab is None else _next_pow2(max(ALIGN, int(min_slab)))
        #: every free range of every slab as ``(size, slab order, start)``, sorted: the
        #: best fit is one bisection away (a scan of every slab would cost each saved
        #: tensor time in proportion to the slabs, which grow with the step)
        self._free: list[tuple[int, int, int]] = []
        #: the slabs by creation order (a dict keeps it)
        self._by_order: dict[int, _Slab] = {}
        self._made = 0
        self._lock = threading.Lock()
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.peak_bytes = 0
        #: Event of the newest host-to-device copy that reads pool memory (4.1(d)).
        self.h2d_fence: Any = None

    @property
    def _slabs(self) -> list[_Slab]:
        """The slabs, oldest first."""
        return list(self._by_order.values())

    def allocate(self, length: int) -> HostBlock | None:
        """A block of at least ``length`` bytes, or ``None`` when the budget is reached."""
        nbytes = (length + ALIGN - 1) & -ALIGN or ALIGN  # ALIGN is a power of two
        with self._lock:
            # best fit: the smallest free range that holds the request (the oldest slab's,
            # the lowest start, on ties); the block is cut from its front
            free = self._free
            i = bisect.bisect_left(free, (nbytes, -1, -1))
            if i < len(free):
                size, order, start = free.pop(i)
                slab = self._by_order[order]
            else:
                grown = self._grow(nbytes)
                if grown is None:
                    return None
                slab, size, start = grown, grown.size, 0
                free.remove((size, slab.order, 0))
            starts, sizes = slab.starts, slab.sizes
            j = bisect.bisect_left(starts, start)
            if size == nbytes:
                del starts[j]
                del sizes[j]
            else:
                starts[j] = start + nbytes
                sizes[j] = size - nbytes
                bisect.insort(free, (size - nbytes, slab.order, start + nbytes))
            slab.used += nbytes
            in_use = self.in_use_bytes = self.in_use_bytes + nbytes
            if in_use > self.peak_bytes:
                self.peak_bytes = in_use
            return HostBlock(slab, start, nbytes, length)

    def _give(self, slab: _Slab, start: int, nbytes: int) -> None:
        """Return ``[start, start + nbytes)`` of ``slab`` to the free ranges, merged with
        its neighbours (lock held)."""
        starts, sizes, order = slab.starts, slab.sizes, slab.order
        # a slab dropped by close() keeps its own lists only
        free: list[tuple[int, int, int]] = self._free if self._by_order.get(order) is slab else []
        i = bisect.bisect_left(starts, start)
        # merge with the following range, then with the preceding one
        if i < len(starts) and start + nbytes == starts[i]:
            if free is self._free:
                free.remove((sizes[i], order, starts[i]))
            nbytes += sizes[i]
            del starts[i]
            del sizes[i]
        if i > 0 and starts[i - 1] + sizes[i - 1] == start:
            if free is self._free:
                free.remove((sizes[i - 1], order, starts[i - 1]))
            sizes[i - 1] += nbytes
            bisect.insort(free, (sizes[i - 1], order, starts[i - 1]))
        else:
            starts.insert(i, start)
            sizes.insert(i, nbytes)
            bisect.insort(free, (nbytes, order, start))

    def _grow(self, nbytes: int) -> _Slab | None:
        floor = MIN_SLAB_BYTES if self.min_slab is None else self.min_slab
        size = max(floor, _next_pow2(nbytes))
        if self.ahead:  # a power of two in [reserved / 4, reserved / 2)
            size = max(size, min(MAX_AHEAD_SLAB, _next_pow2(self.reserved_bytes + 1) // 4))
        if self.reserved_bytes + size > self.limit:
            # Empty slabs that are too small for this request are worth less than one
            # that fits: return them first (never with ``retain``: host addresses must
            # stay valid until close()).
            if not self.retain:
                for slab in [s for s in self._by_order.values() if s.used == 0]:
                    del self._by_order[slab.order]
                    self._free.remove((slab.size, slab.order, 0))
                    self.reserved_bytes -= slab.size
            if self.reserved_bytes + size > self.limit:
                size = _next_pow2(nbytes)
                if self.reserved_bytes + size > self.limit:
                    return None
        pin = self.pin and torch.cuda.is_available()
        try:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError:  # the system refused the memory: behave as over budget
            return None
        if pin and not self._said_pinning and self.reserved_bytes + size >= PINNING_NOTE_BYTES:
            self._said_pinning = True
            print(_PINNING_NOTE.format(gib=PINNING_NOTE_BYTES / 2**30), file=sys.stderr, flush=True)
        slab = _Slab(buffer, self._made)
        self._made += 1
        self._by_order[slab.order] = slab
        bisect.insort(self._free, (size, slab.order, 0))
        self.reserved_bytes += size
        return slab

    def extend(self, block: HostBlock, length: int) -> bool:
        """Grow ``block`` in place to ``length`` requested bytes when the bytes right
        after it are free and the budget allows (a filling bucket of small tensors);
        returns whether it did. The block's start does not move, so views of its
        first bytes stay valid."""
        nbytes = (length + ALIGN - 1) & -ALIGN or ALIGN
        extra = nbytes - block.nbytes
        with self._lock:
            if extra > 0:
                slab: _Slab = block.slab  # type: ignore[assignment]
                if self._by_order.get(slab.order) is not slab:  # dropped by close()
                    return False
                end = block.start + block.nbytes
                starts, sizes = slab.starts, slab.sizes
                i = bisect.bisect_left(starts, end)
                if i == len(starts) or starts[i] != end or sizes[i] < extra:
                    return False
                self._free.remove((sizes[i], slab.order, end))
                if sizes[i] == extra:
                    del starts[i]
                    del sizes[i]
                else:
                    starts[i] = end + extra
                    sizes[i] -= extra
                    bisect.insort(self._free, (sizes[i], slab.order, end + extra))
                slab.used += extra
                in_use = self.in_use_bytes = self.in_use_bytes + extra
                if in_use > self.peak_bytes:
                    self.peak_bytes = in_use
                block.nbytes = nbytes
            block.length = max(length, block.length)
            block._tensor = None
            return True

    def trim(self, block: HostBlock, length: int) -> None:
        """Shrink ``block`` to ``length`` requested bytes (at most its own), giving its
        aligned tail back to its slab: a block reserved for a filling bucket of small
        tensors (the activation offloader's gathered copies) keeps what it used."""
        nbytes = (length + ALIGN - 1) & -ALIGN or ALIGN
        tail = block.nbytes - nbytes
        with self._lock:
            if tail > 0:
                slab: _Slab = block.slab  # type: ignore[assignment]
                self._give(slab, block.start + nbytes, tail)
                slab.used -= tail
                self.in_use_bytes -= tail
                block.nbytes = nbytes
            block.length = min(length, block.length)
            block._tensor = None

    def free(self, block: HostBlock) -> None:
        """Return ``block`` to its slab; the caller guarantees no copy still reads it."""
        nbytes = block.nbytes
        with self._lock:
            slab: _Slab = block.slab  # type: ignore[assignment]
            self._give(slab, block.start, nbytes)
            slab.used -= nbytes
            self.in_use_bytes -= nbytes
            block.slab = None
            block._tensor = None

    def close(self) -> None:
        """Drop every slab. Blocks still handed out keep their own slab alive."""
        with self._lock:
            self._free.clear()
            self._by_order.clear()
            self.reserved_bytes = 0
        if self.pin and torch.cuda.is_available():
            empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            if empty is not None:
                empty()
