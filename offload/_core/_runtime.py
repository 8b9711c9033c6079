"""What every offloading forward and checkpointed call of one offloader shares.

The lock, the lazily made host pool, one copy backend per device, the frees that a
busy lock deferred, the host blocks bound to captured graphs and the one-time warning
when the host budget is reached. Also the per-thread ``no_offload`` depth.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from offload._core._device import Backend, backend_for
from offload._core._host_pool import HostBlock, HostPool
from offload._core._warn import warn_at_caller

__all__ = ["Runtime", "in_backward", "opted_out"]


class _ThreadState(threading.local):
    #: depth of offload.no_offload() on this thread (a class default: a missing
    #: attribute of a threading.local costs an exception on every lookup)
    no_offload = 0


thread_state = _ThreadState()


def opted_out() -> bool:
    """Whether the calling thread is inside :func:`offload.no_offload`."""
    return thread_state.no_offload > 0


def in_backward() -> bool:
    """Whether the calling thread runs inside autograd's engine (a backward)."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1


def enter_no_offload() -> None:
    thread_state.no_offload += 1


def exit_no_offload() -> None:
    thread_state.no_offload -= 1


class Runtime:
    """State shared by the forwards (or checkpointed calls) of one offloader.

    Args:
        config: anything with ``host_memory_limit`` and ``pin_memory`` (an
            :class:`offload.OffloadConfig`, or the checkpoint's settings).
        offload_stream: the CUDA stream of every copy (``None``: one per device).
        retain_host: keep the pool's slabs when blocks return (``retain_pinned_cpu_buffers``).
        name: how the host-limit warning names the caller. Default ``"offload"``.
        hint: what the host-limit warning tells to raise. Default ``"host_memory_limit"``.
    """

    def __init__(
        self,
        config: Any,
        *,
        offload_stream: Any = None,
        retain_host: bool = False,
        name: str = "offload",
        hint: str = "host_memory_limit",
    ) -> None:
        self.config = config
        self.offload_stream = offload_stream
        #: host blocks bound to captured CUDA graphs (Note [release order], "CUDA
        #: graphs"): never returned to the pool, since replays write them; released by
        #: free_graph_memory() (close() keeps them)
        self.graph_blocks: list[HostBlock] = []
        self.retain_host = retain_host
        self.lock = threading.Lock()
        self._pool: HostPool | None = None
        self._backends: dict[torch.device, Backend] = {}
        #: work that could not take the lock (a handle or a copy died on another thread,
        #: or under the lock): ``(function, argument, argument)``, done by ``drain``
        self.graveyard: collections.deque[tuple[Callable[..., None], Any, Any]] = (
            collections.deque()
        )
        self.warned_host_limit = False
        self.name = name
        self.hint = hint

    @functools.cached_property
    def pool(self) -> HostPool:
        """The host pool, made at first use (``_pool`` stays ``None`` until then); a
        cached property: read for every offloaded tensor, it costs an attribute lookup
        once made."""
        self._pool = HostPool(
            self.config.host_memory_limit, self.config.pin_memory, retain=self.retain_host
        )
        return self._pool

    @property
    def pool_if_made(self) -> HostPool | None:
        """The host pool, or ``None`` where nothing has needed one yet (reading
        :attr:`pool` would make it)."""
        return self._pool

    def backend(self, device: torch.device) -> Backend:
        b = self._backends.get(device)
        if b is None:
            b = self._backends[device] = backend_for(device, self.offload_stream)
        return b

    def later(self, fn: Callable[..., None], a: Any, b: Any = None) -> None:
        """Run ``fn(a, b)`` under the lock: now if it is free, else at the next drain.
        Never blocks: a handle can die on any thread, also one holding the lock."""
        if self.lock.acquire(blocking=False):
            try:
                if self.graveyard:
                    self.drain()
                fn(a, b)
            finally:
                self.lock.release()
        else:
            self.graveyard.append((fn, a, b))

    def free(self, block: HostBlock, _unused: Any = None) -> None:
        """Return ``block`` to the pool (lock held)."""
        self._pool.free(block)  # type: ignore[union-attr]

    def drain(self) -> None:
        """Do the work queued while the lock was busy (lock held)."""
        graveyard = self.graveyard
        while graveyard:
            fn, a, b = graveyard.popleft()
            fn(a, b)

    def close(self) -> None:
        """Give the pool's slabs back, except those of graph-bound blocks (each block
        keeps its slab alive): a captured graph may still be replayed. The pool can
        grow again if the offloader is reused."""
        with self.lock:
            self.drain()
            if self._pool is not None:
                self._pool.close()

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

    def warn_host_limit(self, nbytes: int, what: str = "a tensor") -> None:
        """Warn once that the host budget is reached (a save of ``nbytes`` stays)."""
        if not self.warned_host_limit:
            self.warned_host_limit = True
            pool = self.pool
            warn_at_caller(
                f"{self.name}: the host memory budget is reached ({pool.reserved_bytes} "
                f"of host_memory_limit={pool.limit} bytes reserved; {what} of {nbytes} "
                f"bytes stays on the device, reason 'host_limit'). Raise {self.hint} to "
                f"offload more; training stays correct.",
                RuntimeWarning,
            )
