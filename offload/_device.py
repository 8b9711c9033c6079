"""The one module that knows about streams and events.

Two backends implement the same small interface:

* :class:`CudaBackend` issues device-to-host copies on one side stream and host-to-device
  copies on another, and orders them against the compute stream with events only
  (``wait_stream`` / ``wait_event``: no host synchronisation).
* :class:`SyncBackend` is the path for machines without an accelerator (and for CPU
  tensors anywhere): every copy happens at once on the calling thread and every event
  is ``None``.

Numbers like 4.1(a) refer to the ordering invariants of ``docs/design.md``, section 4.
The scheduler (``_scheduler.py``) decides *when* to copy, release and reload; this
module only says *how*. See ``# Note [release order]`` in ``_scheduler.py`` for why each
wait is where it is.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from offload import _compress

__all__ = ["Backend", "CudaBackend", "SyncBackend", "backend_for"]


#: Where a backend appends timing records when asked: ``(kind, seconds)`` measured on
#: the host (synchronous path) or ``(kind, start_event, end_event)`` on a device stream.
#: ``kind`` is ``"d2h"``, ``"h2d"`` or ``"stall"`` (the compute stream waiting for a copy).
Times = list[tuple[Any, ...]]

#: One copy: ``(src, dst, codec)``. ``codec`` is ``None`` (copy the bytes exactly) or
#: the dtype of the elements (``compress="fp8"``): D2H quantizes ``src`` (a byte view
#: of whole elements of that dtype) into the packed form of ``offload/_compress.py``,
#: whose bytes are ``dst``; H2D dequantizes the packed host bytes ``src`` into ``dst``.
Copies = list[tuple[torch.Tensor, torch.Tensor, torch.dtype | None]]


def _pack_into(src: torch.Tensor, dst: torch.Tensor, codec: torch.dtype) -> None:
    """Quantize the device bytes ``src`` into the host bytes ``dst``, through a packed
    device buffer allocated on the current stream (the copy stream: the buffer's block
    returns to that stream's pool and is reused only behind this copy)."""
    packed = torch.empty(dst.numel(), dtype=torch.uint8, device=src.device)
    _compress.quantize_into(src.view(codec), packed)
    dst.copy_(packed, non_blocking=True)


def _unpack_into(src: torch.Tensor, dst: torch.Tensor, codec: torch.dtype) -> None:
    """Copy the packed host bytes ``src`` to the device and dequantize them into ``dst``
    (on the current stream, the reload stream; same pool argument as ``_pack_into``)."""
    packed = torch.empty(src.numel(), dtype=torch.uint8, device=dst.device)
    packed.copy_(src, non_blocking=True)
    _compress.dequantize_into(packed, dst.view(codec))


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

    def d2h(self, pairs: Copies, fence: Any, times: Times | None = None) -> None:
        """Copy each device ``src`` into its host ``dst``, after the work that produced
        them (everything queued so far on the current stream)."""
        start = time.perf_counter() if times is not None else 0.0
        for src, dst, codec in pairs:
            if codec is None:
                dst.copy_(src)
            else:
                _compress.quantize_into(src.view(codec), dst)
        if times is not None:
            times.append(("d2h", time.perf_counter() - start))

    def record_d2h(self) -> Any:
        """An event marking the end of every D2H copy issued so far."""
        return None

    def alloc(self, sizes: list[int], stream: Any) -> list[torch.Tensor]:
        """Device byte buffers of ``sizes`` allocated in ``stream``'s pool."""
        return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]

    def h2d(
        self,
        pairs: Copies,
        waits: list[Any],
        stream: Any,
        times: Times | None = None,
    ) -> Any:
        """Copy each host ``src`` into its device ``dst``; returns the reload event."""
        start = time.perf_counter() if times is not None else 0.0
        for src, dst, codec in pairs:
            if codec is None:
                dst.copy_(src)
            else:
                _compress.dequantize_into(src, dst.view(codec))
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


class CudaBackend(Backend):
    """Copies on side streams, ordered with events (docs/design.md 3, invariants 4.1)."""

    is_async = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        with torch.cuda.device(device):
            self.d2h_stream = torch.cuda.Stream(device)
            self.h2d_stream = torch.cuda.Stream(device)
        # One event re-recorded for every copy: a wait enqueued on a stream waits for
        # the record made before it, so recording again later is safe, and saves an
        # event creation per saved tensor (the hot path).
        self._ready = torch.cuda.Event()
        self._fence_waited: Any = None

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def d2h(self, pairs: Copies, fence: Any, times: Times | None = None) -> None:
        compute = torch.cuda.current_stream(self.device)
        stream = self.d2h_stream
        # 4.1(a): the copies start only after everything queued so far on the producing
        # (current) stream, which includes the kernels that wrote the sources.
        self._ready.record(compute)
        stream.wait_event(self._ready)
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
            for src, dst, codec in pairs:
                if codec is None:
                    dst.copy_(src, non_blocking=True)
                else:
                    _pack_into(src, dst, codec)
            if times is not None:
                end.record()
                times.append(("d2h", start, end))
        finally:
            torch.cuda.set_stream(compute)

    def record_d2h(self) -> torch.cuda.Event:
        return self.d2h_stream.record_event()

    def alloc(self, sizes: list[int], stream: torch.cuda.Stream) -> list[torch.Tensor]:
        # The caching allocator keeps one pool per stream: allocate in the pool of the
        # stream that will read and later free the buffers (the compute stream).
        with torch.cuda.stream(stream):
            return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]

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
        with torch.cuda.stream(self.h2d_stream):
            if times is not None:
                start = _timed_event()
                start.record()
            for src, dst, codec in pairs:
                if codec is None:
                    dst.copy_(src, non_blocking=True)
                else:
                    _unpack_into(src, dst, codec)
            if times is not None:
                end = _timed_event()
                end.record()
                times.append(("h2d", start, end))
        return self.h2d_stream.record_event()

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
        self.wait(torch.cuda.current_stream(self.device), event, times)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()


def backend_for(device: torch.device) -> Backend:
    """The backend that moves tensors living on ``device``."""
    if device.type == "cuda":
        return CudaBackend(device)
    return SyncBackend(device)
