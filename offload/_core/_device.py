"""The one module that knows about streams and events.

Two backends implement the same small interface:

* :class:`CudaBackend` issues device-to-host copies on one side stream and host-to-device
  copies on another, and orders them against the compute stream with events only
  (``wait_stream`` / ``wait_event``: no host synchronisation).
* :class:`SyncBackend` is the path for machines without an accelerator (and for CPU
  tensors anywhere): every copy happens at once on the calling thread and every event
  is ``None``.

Numbers like 4.1(a) refer to the ordering invariants of ``docs/design.md``, section 4.
The step (``_step.py``) decides *when* to copy, release and reload; this
module only says *how*. See ``# Note [release order]`` in ``_step.py`` for why each
wait is where it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from offload._core import _compress

__all__ = [
    "Backend",
    "CudaBackend",
    "Request",
    "SyncBackend",
    "backend_for",
    "capturing",
    "empty",
]


#: Where a backend appends timing records when asked: ``(kind, seconds)`` measured on
#: the host (synchronous path) or ``(kind, start_event, end_event)`` on a device stream.
#: ``kind`` is ``"d2h"``, ``"h2d"`` or ``"stall"`` (the compute stream waiting for a copy).
Times = list[tuple[Any, ...]]

#: A reload buffer to allocate: a byte count (a 1-D ``uint8`` buffer) or ``(dtype,
#: size, stride)`` (a buffer of that geometry: the exact copy of a contiguous tensor
#: that filled its whole storage, rebuilt without a byte view).
Request = int | tuple[torch.dtype, torch.Size, tuple[int, ...]]


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph. Never initializes
    CUDA: without an initialized CUDA context nothing can be capturing."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def empty(request: Request, device: torch.device) -> torch.Tensor:
    """A fresh buffer for ``request`` on ``device`` (the current stream's pool)."""
    if isinstance(request, int):
        return torch.empty(request, dtype=torch.uint8, device=device)
    dtype, size, stride = request
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


#: One copy: ``(src, dst, codec)``. ``codec`` is ``None`` (copy the bytes exactly) or
#: the dtype of the elements (``compress="fp8"``): D2H quantizes ``src`` (a byte view
#: of whole elements of that dtype) into ``dst``, chunk by chunk (``CHUNK_ELEMENTS``):
#: the host bytes are the packed forms of ``offload/_core/_compress.py`` of each chunk, back
#: to back; H2D dequantizes them into ``dst``. Both backends use this layout.
Copies = list[tuple[torch.Tensor, torch.Tensor, torch.dtype | None]]


def _copy_exact(pairs: Copies, non_blocking: bool = False) -> bool:
    """Issue every copy of ``pairs`` in one call when none has a codec; returns False
    (and copies nothing) when one has. One ``torch._foreach_copy_`` runs, pair by pair
    and in order, the same ``dst.copy_(src, non_blocking)`` as a loop would (sources and
    destinations on different devices, or several dtypes, take its per-tensor path),
    without a Python call per pair: this runs for every offloaded tensor."""
    for _src, _dst, codec in pairs:
        if codec is not None:
            return False
    if len(pairs) == 1:  # one copy (a layer's input, say): the plain call is cheaper
        pairs[0][1].copy_(pairs[0][0], non_blocking=non_blocking)
    elif pairs:
        srcs, dsts, _ = zip(*pairs)
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
    return True


class Backend:
    """Interface shared by the synchronous and the CUDA backend.

    Every method that copies or waits takes ``times``: ``None`` (no timing, the default
    and the hot path) or a list that receives one record per copy or wait.
    """

    #: True when copies run beside the compute stream and need events.
    is_async: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        return None

    def d2h(
        self,
        pairs: Copies,
        fence: Any,
        times: Times | None = None,
        transient: list[torch.Tensor] | None = None,
        ready: Any = None,
    ) -> None:
        """Copy each device ``src`` into its host ``dst``, after the work that produced
        them: everything queued so far on the current stream, or, when ``ready`` is
        given (a :meth:`mark_ready` made after the sources were produced), the work
        queued before that mark. ``transient``: sources the caller drops after the call
        (flat copies of gathered tensors); their memory is not reused before their
        copies have read them."""
        start = time.perf_counter() if times is not None else 0.0
        if not _copy_exact(pairs):
            for src, dst, codec in pairs:
                if codec is None:
                    dst.copy_(src)
                    continue
                for part, packed in _chunks(src.view(codec), dst):
                    _compress.quantize_into(part, packed)
        if times is not None:
            times.append(("d2h", time.perf_counter() - start))

    def record_d2h(self) -> Any:
        """An event marking the end of every D2H copy issued so far."""
        return None

    def mark_ready(self) -> Any:
        """A mark of the work queued so far on the current stream, for a later
        :meth:`d2h` (``ready``) whose sources that work produced."""
        return None

    def alloc(self, sizes: list[Request], stream: Any) -> list[torch.Tensor]:
        """Device buffers (byte counts or geometries: :data:`Request`) allocated in
        ``stream``'s pool."""
        device = self.device
        return [empty(n, device) for n in sizes]

    def h2d(
        self,
        pairs: Copies,
        waits: list[Any],
        stream: Any,
        times: Times | None = None,
    ) -> Any:
        """Copy each host ``src`` into its device ``dst``; returns the reload event."""
        start = time.perf_counter() if times is not None else 0.0
        if not _copy_exact(pairs):
            for src, dst, codec in pairs:
                if codec is None:
                    dst.copy_(src)
                    continue
                for part, packed in _chunks(dst.view(codec), src):
                    _compress.dequantize_into(packed, part)
        if times is not None:
            times.append(("h2d", time.perf_counter() - start))
        return None

    def wait(self, stream: Any, event: Any, times: Times | None = None) -> None:
        """Make ``stream`` wait for ``event`` on the device (no host sync)."""

    def wait_current(self, event: Any, times: Times | None = None) -> None:
        """Make the current stream wait for ``event``."""

    def record(self, stream: Any) -> Any:
        """An event marking everything queued on ``stream`` so far (``None`` here)."""
        return None

    def host_wait(self, event: Any) -> None:
        """Block the calling thread until ``event`` has completed (no-op for ``None``).

        Never on the hot path: for host code that reads or writes host bytes a copy may
        still be using (weight offloading's ``push()``, ``state_dict()``, its gradient
        worker thread)."""
        if event is not None:
            event.synchronize()


class SyncBackend(Backend):
    """Every copy completes before the call returns; events are ``None``; nothing ever
    waits, so no stall is recorded."""


def _timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class _Staging:
    """:data:`STAGING_SLOTS` device slots through which compressed copies pass, one
    direction's.

    ``compress="fp8"`` needs the packed bytes on the device: D2H quantizes a source into
    a slot (codec stream) and copies the slot to the host (copy stream); H2D copies the
    host bytes into a slot (copy stream) and dequantizes the slot into the reload buffer
    (codec stream). The slots are used in turn, so the codec kernels of the next chunks
    run while the link carries earlier ones, and the device memory this costs is bounded
    by that many packed chunks (the largest seen), kept across steps until the backend
    is dropped. One use of a slot is :meth:`write` (the writer stream waits for the
    slot's last reader), :meth:`hand_over` (the reader stream waits for the writer) and
    :meth:`release` (after the reader's work on it is queued). Per slot ``i``, two
    events are recorded again at every use (none is made per chunk): ``filled[i]`` by
    the writer, ``drained[i]`` by the reader; ``used[i]`` says whether ``drained[i]``
    has been recorded since the buffer was made. A stream's ``wait_event`` waits for
    the record made before the wait was issued, so recording an event again never
    changes a wait already queued.
    """

    __slots__ = ("buffer", "count", "drained", "filled", "slot_bytes", "turn", "used")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.slot_bytes = 0
        self.turn = 0
        self.count = STAGING_SLOTS
        self.used = [False] * self.count
        self.filled = [torch.cuda.Event() for _ in range(self.count)]
        self.drained = [torch.cuda.Event() for _ in range(self.count)]

    def write(
        self, nbytes: int, device: torch.device, writer: Any, reader: Any
    ) -> tuple[torch.Tensor, int]:
        """The next slot, at least ``nbytes`` (a view), and its index, for ``writer``
        to fill: ``writer`` waits for the work the slot's last reader queued on it."""
        slot, i = self._slot(nbytes, device, writer, reader)
        if self.used[i]:
            writer.wait_event(self.drained[i])
        return slot, i

    def hand_over(self, i: int, writer: Any, reader: Any) -> None:
        """``writer`` queued its write of slot ``i``: ``reader`` waits for it."""
        self.filled[i].record(writer)
        reader.wait_event(self.filled[i])

    def release(self, i: int, reader: Any) -> None:
        """``reader`` queued its last read of slot ``i``: the next writer waits for it."""
        self.drained[i].record(reader)
        self.used[i] = True

    def _slot(
        self, nbytes: int, device: torch.device, owner: Any, other: Any
    ) -> tuple[torch.Tensor, int]:
        """A slot of at least ``nbytes`` (a view) and its index. A larger buffer is
        allocated in ``owner``'s pool when needed; the old one is released after the
        work already queued on ``other`` (``record_stream``), so no copy reads freed
        memory."""
        if nbytes > self.slot_bytes:
            old = self.buffer
            self.slot_bytes = (nbytes + _SLOT_ROUND - 1) // _SLOT_ROUND * _SLOT_ROUND
            with torch.cuda.stream(owner):
                self.buffer = torch.empty(
                    self.count * self.slot_bytes, dtype=torch.uint8, device=device
                )
            if old is not None:
                old.record_stream(other)
            # the new block may be one ``owner`` freed: stream order on ``owner`` keeps it
            # safe; ``other`` must not still use it: it waits for ``owner`` below
            other.wait_stream(owner)
            self.used = [False] * self.count
        i = self.turn
        self.turn = (i + 1) % self.count
        start = i * self.slot_bytes
        return self.buffer[start : start + nbytes], i  # type: ignore[index]


#: Staging slots per direction of compressed copies (:class:`_Staging`). Two would let a
#: codec kernel overlap the previous chunk's copy, but a kernel that starts late (queued
#: beside the compute's kernels) then leaves the link idle; four absorb that delay.
#: Each slot holds one packed chunk (about 33 MiB: ``CHUNK_ELEMENTS``).
STAGING_SLOTS = 4

#: Slot sizes are rounded up to this many bytes (fewer regrowths for similar shapes).
_SLOT_ROUND = 1 << 20

#: Elements per chunk of a compressed copy (a multiple of the codec's block): a large
#: tensor passes through the staging slots in chunks, so a slot holds at most
#: ``packed_nbytes(CHUNK_ELEMENTS)`` (about 33 MiB; smaller chunks make the host time of
#: issuing each chunk's kernel, events and copy pace the forward) and each chunk's codec
#: kernel overlaps the previous chunk's copy.
CHUNK_ELEMENTS = 32 << 20


def _chunks(
    elements: torch.Tensor, packed: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs ``(elements[a:b], packed bytes of that chunk)``: the packed form of a span
    is the concatenation of its chunks' packed forms (``_compress.packed_nbytes`` of
    the whole equals the sum over chunks, since a chunk is a whole number of blocks)."""
    n = elements.numel()
    offset = 0
    for a in range(0, n, CHUNK_ELEMENTS):
        part = elements[a : a + CHUNK_ELEMENTS]
        size = _compress.packed_nbytes(part.numel())
        yield part, packed[offset : offset + size]
        offset += size


class CudaBackend(Backend):
    """Copies on side streams, ordered with events (docs/design.md 3, invariants 4.1).

    With ``compress="fp8"`` two more streams of the highest priority run the codec
    kernels (one per direction): at normal priority a quantize kernel queued beside a
    large matmul waits for most of the matmul's blocks before it gets a
    multiprocessor, and the link idles meanwhile. The staging slots (:class:`_Staging`)
    overlap each codec kernel with the copy of the previous tensor.
    """

    is_async = True

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        super().__init__(device)
        # an int for torch.cuda.current_stream: a torch.device costs it several checks,
        # and these calls run a few times per offloaded layer call
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        if stream is None:
            with torch.cuda.device(device):
                self.d2h_stream = torch.cuda.Stream(device)
                self.h2d_stream = torch.cuda.Stream(device)
        else:
            # A caller's stream (get_cpu_offload_context(offload_stream=...)) carries both
            # directions, as in TransformerEngine: every ordering below still holds (each
            # copy waits for the same events; the two directions are merely serialized).
            self.d2h_stream = self.h2d_stream = stream
        # One event re-recorded for every copy: a wait enqueued on a stream waits for
        # the record made before it, so recording again later is safe, and saves an
        # event creation per saved tensor (the hot path).
        self._ready = torch.cuda.Event()
        self._fence_waited: Any = None
        self._codec: dict[str, tuple[torch.cuda.Stream, _Staging]] = {}

    def _codec_stream(self, direction: str) -> tuple[torch.cuda.Stream, _Staging]:
        """The codec stream and staging slots of ``direction`` (made at first use)."""
        made = self._codec.get(direction)
        if made is None:
            with torch.cuda.device(self.device):
                high = torch.cuda.Stream(self.device, priority=-100)  # clamped to the highest
            made = self._codec[direction] = (high, _Staging())
        return made

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._index)

    def d2h(
        self,
        pairs: Copies,
        fence: Any,
        times: Times | None = None,
        transient: list[torch.Tensor] | None = None,
        ready: Any = None,
    ) -> None:
        compute = torch.cuda.current_stream(self._index)
        stream = self.d2h_stream
        # 4.1(a): the copies start only after everything queued so far on the producing
        # (current) stream, which includes the kernels that wrote the sources; or after
        # the work before `ready`, recorded once they were written.
        if ready is None:
            ready = self._ready
            ready.record(compute)
        stream.wait_event(ready)
        if fence is not None and fence is not self._fence_waited:
            # 4.1(d): the host bytes may still be read by an earlier step's H2D. Once
            # the D2H stream waited for a fence, every later copy on it is behind it.
            stream.wait_event(fence)
            self._fence_waited = fence
        torch.cuda.set_stream(stream)
        try:
            if times is not None:
                start, end = _timed_event(), _timed_event()
                start.record()
            codec_stream: Any = None
            # every pair plain (the usual case): all issued at once, nothing left to loop
            plain = _copy_exact(pairs, non_blocking=True)
            for src, dst, codec in () if plain else pairs:
                if codec is None:
                    dst.copy_(src, non_blocking=True)
                    continue
                if codec_stream is None:
                    codec_stream, staging = self._codec_stream("d2h")
                    codec_stream.wait_event(ready)  # 4.1(a) for the quantize kernels
                # per chunk: the codec stream quantizes into a slot once the copy that
                # last read it is done, the copy stream sends the slot once quantized.
                # Streams are switched with set_stream (the finally below restores the
                # compute stream): this loop's host time paces the forward
                for part, packed in _chunks(src.view(codec), dst):
                    slot, i = staging.write(packed.numel(), self.device, codec_stream, stream)
                    torch.cuda.set_stream(codec_stream)
                    _compress.quantize_into(part, slot)
                    staging.hand_over(i, codec_stream, stream)
                    torch.cuda.set_stream(stream)
                    packed.copy_(slot, non_blocking=True)
                    staging.release(i, stream)
            if times is not None:
                end.record()
                times.append(("d2h", start, end))
            if transient:
                # allocated on the compute stream and dropped by the caller: the
                # allocator reuses their blocks only after the copies queued here
                for t in transient:
                    t.record_stream(stream)
        finally:
            torch.cuda.set_stream(compute)

    def record_d2h(self) -> torch.cuda.Event:
        return self.d2h_stream.record_event()

    def mark_ready(self) -> torch.cuda.Event:
        return torch.cuda.current_stream(self._index).record_event()

    def alloc(self, sizes: list[Request], stream: torch.cuda.Stream) -> list[torch.Tensor]:
        # The caching allocator keeps one pool per stream: allocate in the pool of the
        # stream that will read and later free the buffers (the compute stream).
        device = self.device
        current = torch.cuda.current_stream(self._index)
        if stream == current:
            return [empty(n, device) for n in sizes]
        torch.cuda.set_stream(stream)
        try:
            return [empty(n, device) for n in sizes]
        finally:
            torch.cuda.set_stream(current)

    def h2d(
        self,
        pairs: Copies,
        waits: list[Any],
        stream: torch.cuda.Stream,
        times: Times | None = None,
    ) -> torch.cuda.Event:
        # The buffers were just allocated on ``stream``; their blocks may have been freed
        # there by kernels still queued: write them only after those kernels (4.1(e)).
        self.h2d_stream.wait_stream(stream)
        for event in waits:  # the D2H copies that filled the host bytes
            if event is not None:
                self.h2d_stream.wait_event(event)
        copy_stream = self.h2d_stream
        codec_stream: Any = None
        current = torch.cuda.current_stream(self._index)
        torch.cuda.set_stream(copy_stream)
        try:
            if times is not None:
                start = _timed_event()
                start.record()
            # every pair plain (the usual case): all issued at once, nothing left to loop
            plain = _copy_exact(pairs, non_blocking=True)
            for src, dst, codec in () if plain else pairs:
                if codec is None:
                    dst.copy_(src, non_blocking=True)
                    continue
                if codec_stream is None:
                    codec_stream, staging = self._codec_stream("h2d")
                for part, packed in _chunks(dst.view(codec), src):
                    slot, i = staging.write(packed.numel(), self.device, copy_stream, codec_stream)
                    slot.copy_(packed, non_blocking=True)
                    # the codec stream follows the copy stream, which waited for ``stream``
                    # (4.1(e): the reload buffer's block) and for the D2H (``waits``)
                    staging.hand_over(i, copy_stream, codec_stream)
                    torch.cuda.set_stream(codec_stream)
                    _compress.dequantize_into(slot, part)
                    staging.release(i, codec_stream)
                    torch.cuda.set_stream(copy_stream)
            done = copy_stream
            if codec_stream is not None:  # the reload event covers both streams' work
                codec_stream.wait_stream(copy_stream)
                done = codec_stream
            if times is not None:
                end = _timed_event()
                end.record(done)
                times.append(("h2d", start, end))
        finally:
            torch.cuda.set_stream(current)
        return done.record_event()

    def wait(self, stream: torch.cuda.Stream, event: Any, times: Times | None = None) -> None:
        if event is None:
            return
        if times is None:
            stream.wait_event(event)
            return
        # Two events around the wait on the waiting stream: their distance is the time
        # that stream stood still (0 when the copy was already done).
        before, after = _timed_event(), _timed_event()
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        times.append(("stall", before, after))

    def wait_current(self, event: Any, times: Times | None = None) -> None:
        self.wait(torch.cuda.current_stream(self._index), event, times)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()


def backend_for(device: torch.device, stream: torch.cuda.Stream | None = None) -> Backend:
    """The backend that moves tensors living on ``device``; ``stream``: a CUDA stream of
    that device to carry every copy (``None``: the backend makes its own streams)."""
    if stream is not None:
        if device.type != "cuda":
            raise RuntimeError(
                f"offload_stream is a CUDA stream, but the saved tensors live on {device}; "
                f"pass offload_stream=None for tensors that are not on a CUDA device"
            )
        if stream.device != device:
            raise RuntimeError(
                f"offload_stream belongs to {stream.device}, but the saved tensors live on "
                f"{device}; create the stream on the device the layers run on"
            )
        return CudaBackend(device, stream)
    if device.type == "cuda":
        return CudaBackend(device)
    return SyncBackend(device)
