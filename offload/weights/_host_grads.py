"""Host gradients (``grads="host"``): fp32 masters and ``main_grad`` in host memory, the
D2H copies of each gradient and the worker thread that adds them (Note [weight
residency], 7-8), the device staging of fused layers' dW, and ``push()``."""

from __future__ import annotations

import functools
import queue
import threading
from typing import TYPE_CHECKING, Any

import torch

from offload._core._host_pool import HostBlock, HostPool
from offload.weights._storage import free_storage, host_view

if TYPE_CHECKING:
    from offload._core._device import Backend
    from offload.weights._residency import _Layers, _WeightSlot
    from offload.weights._storage import _WeightParam

NO_LIMIT = 1 << 62  # the weights must fit: no budget, a refusal is an error


class _GradWorker:
    """A thread that waits for gradient copies on the host and adds them into
    ``main_grad`` (Note [weight residency], 8). Holds no reference to the offloader."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def submit(self, event: Any, job: Any) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._run, name="offload-weight-grads", daemon=True
            )
            self.thread.start()
        self.jobs.put((event, job))

    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            try:
                if item is None:
                    return
                event, job = item
                self.backend.host_wait(event)
                job()
            except BaseException as exc:  # reported by drain()
                self.error = exc
            finally:
                self.jobs.task_done()

    def drain(self) -> None:
        """Wait until every submitted job is done; re-raise a job's error."""
        if self.thread is not None:
            self.jobs.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("offload: adding a gradient into main_grad failed") from error

    def close(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None


def _accumulate(
    master: torch.Tensor, main_grad: torch.Tensor, src: torch.Tensor, overwrite: bool
) -> None:
    """``master.grad += src`` (``= src`` with ``overwrite`` or after ``zero_grad``)."""
    with torch.no_grad():
        dst = master.grad
        if dst is None:  # optimizer.zero_grad(set_to_none=True): start again
            master.grad = dst = main_grad
            overwrite = True
        if overwrite:
            dst.copy_(src)
        else:
            dst.add_(src)


def _grad_job(
    master: torch.Tensor,
    main_grad: torch.Tensor,
    src: torch.Tensor,
    overwrite: bool,
    pool: HostPool,
    block: HostBlock,
) -> None:
    try:
        _accumulate(master, main_grad, src, overwrite)
    finally:
        pool.free(block)


class _Keep:
    """Keeps a device tensor alive until the stream that allocated it waited for the copy
    that reads it (the pending list drops it then)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _HostGrads:
    """The gradient side of one offloader's slots: what moves each gradient to the host
    and what still has to wait for those copies. With ``grads="device"`` nothing is ever
    pending or staged and its methods do nothing."""

    def __init__(self, backend: Backend, host: bool, pin_memory: bool) -> None:
        self.backend = backend
        self.pin_memory = pin_memory
        # device tensors whose D2H copies are in flight: (slot, event, stream, payload)
        self.pending: list[tuple[int, Any, Any, Any]] = []
        self.pool: HostPool | None = None  # pinned staging of gradient copies, made lazily
        self.worker = _GradWorker(backend) if host and backend.is_async else None

    @staticmethod
    def add_master(prm: _WeightParam, device: torch.device) -> None:
        """Give a trainable parameter its fp32 host master and ``main_grad`` (and, for a
        fused weight, an empty device staging buffer)."""
        with torch.no_grad():
            prm.master = host_view(prm).to(torch.float32, copy=True)
            prm.main_grad = torch.zeros_like(prm.master)
        prm.master.grad = prm.main_grad
        if prm.fused:
            prm.staging = torch.empty(prm.param.shape, dtype=torch.float32, device=device)
            prm.staging.untyped_storage().resize_(0)

    def grad_to_host(self, slot: _WeightSlot, prm: _WeightParam) -> None:
        """Step 7: move ``p.grad`` into the host ``main_grad`` (lock held)."""
        p = prm.param
        grad = p.grad
        if grad is None:
            return
        p.grad = None
        if prm.fused:  # the zero dummy of grad_added_to_main_grad: dW is in the staging
            return
        overwrite = bool(getattr(p, "overwrite_main_grad", False))
        self._to_main_grad(slot, prm, grad, overwrite, None)

    def _to_main_grad(
        self, slot: _WeightSlot, prm: _WeightParam, grad: torch.Tensor, overwrite: bool, after: Any
    ) -> None:
        backend = self.backend
        if not backend.is_async:
            _accumulate(prm.master, prm.main_grad, grad, overwrite)
            if after is not None:
                after()
            return
        if not grad.is_contiguous():
            grad = grad.contiguous()
        if self.pool is None:
            self.pool = HostPool(NO_LIMIT, self.pin_memory)
        block = self.pool.allocate(grad.nbytes)
        if block is None:
            raise RuntimeError(
                f"offload: could not get {grad.nbytes} bytes of host memory to stage a "
                f"gradient of {slot.where}"
            )
        host = block.tensor.view(grad.dtype).view(grad.shape)
        backend.d2h([(grad, host, None)], None)
        event = backend.record_d2h()
        stream = backend.current_stream()
        payload = after if after is not None else _Keep(grad)
        self.pending.append((slot.sid, event, stream, payload))
        job = functools.partial(
            _grad_job, prm.master, prm.main_grad, host, overwrite, self.pool, block
        )
        self.worker.submit(event, job)  # type: ignore[union-attr]

    def release_pending(self, keep: int | None = None, only: int | None = None) -> None:
        """Device tensors whose D2H copies are in flight: the stream that allocated them
        waits for the copy, then they are dropped (Note [weight residency], 7). ``keep``:
        not those of this slot; ``only``: only those of this slot."""
        if not self.pending:
            return
        rest = []
        for entry in self.pending:
            sid, event, stream, payload = entry
            if sid == keep or (only is not None and sid != only):
                rest.append(entry)
                continue
            self.backend.wait(stream, event)
            if callable(payload):
                payload()
        self.pending = rest

    def set_staging(self, slot: _WeightSlot, allocate: bool) -> None:
        """Fused weights: ``main_grad`` is a device staging buffer while the layer runs
        (memory only during its backward, zeroed there)."""
        for prm in slot.params:
            if prm.staging is None:
                continue
            if allocate and not prm.live:
                self.release_pending(only=slot.sid)  # its last copy must be over
                st = prm.staging.untyped_storage()
                st.resize_(prm.staging.numel() * prm.staging.element_size())
                prm.staging.zero_()
                prm.live = True
            prm.param.main_grad = prm.staging

    @staticmethod
    def unset_staging(slot: _WeightSlot) -> None:
        for prm in slot.params:
            if prm.staging is not None and not prm.live:
                if getattr(prm.param, "main_grad", None) is prm.staging:
                    del prm.param.main_grad

    def flush_staging(self, slot: _WeightSlot) -> None:
        """The layer's backward is over: its fused dW goes to the host ``main_grad``."""
        for prm in slot.params:
            if prm.staging is None or not prm.live:
                continue
            prm.live = False
            if getattr(prm.param, "main_grad", None) is prm.staging:
                del prm.param.main_grad
            overwrite = bool(getattr(prm.param, "overwrite_main_grad", False))
            staging = prm.staging
            self._to_main_grad(
                slot, prm, staging, overwrite, functools.partial(free_storage, staging)
            )

    @staticmethod
    def drop_staging(slot: _WeightSlot) -> None:
        """At close: the fused weights lose their staging ``main_grad``."""
        for prm in slot.params:
            if prm.staging is not None:
                if getattr(prm.param, "main_grad", None) is prm.staging:
                    del prm.param.main_grad
                prm.staging = None

    def drain(self) -> None:
        """Wait until every gradient is in its ``main_grad``; re-raise a worker error."""
        if self.worker is not None:
            self.worker.drain()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.pool is not None:
            self.pool.close()
        self.pool = None


def push(layers: _Layers) -> None:
    """``WeightOffloader.push``: copy the masters into the host weights (and into the
    device copies of resident layers, after their readers)."""
    if layers.host_grads is not None:
        layers.host_grads.drain()
    with layers.lock:
        backend = layers.backend
        backend.host_wait(layers.last_h2d)  # type: ignore[union-attr]
        stream = backend.current_stream()  # type: ignore[union-attr]
        for slot in layers.order:
            masters = [prm for prm in slot.params if prm.master is not None]
            if not masters:
                continue
            backend.host_wait(slot.write_event)  # type: ignore[union-attr]
            slot.write_event = None
            with torch.no_grad():
                for prm in masters:
                    host_view(prm).copy_(prm.master)
            if slot.resident:  # refresh the device copy too, after its readers
                layers.note_h2d(slot.load(backend, [], stream))  # type: ignore[arg-type]
