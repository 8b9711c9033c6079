"""Device buffers for reloads, and their reuse under ``double_buffering=True``.

Without double buffering every reload takes a fresh block from the compute stream's
pool of the caching allocator and gives it back when its group's backward ends. With it,
a finished group's buffers are kept as spares for a later group of equal span sizes
during the same backward, and all spares go when the backward ends.
"""

from __future__ import annotations

from typing import Any

import torch

from offload._core._device import Backend, Request

__all__ = ["ReloadBuffers"]


def _storage_use_count(t: torch.Tensor) -> int:
    # No public API tells whether anything else still references a storage (an output
    # that is a view of a reloaded tensor, a user reference); this private one does.
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class ReloadBuffers:
    """Hands out reload buffers; keeps spares when ``reuse`` is on."""

    __slots__ = ("reuse", "spares", "reuses")

    def __init__(self, reuse: bool) -> None:
        self.reuse = reuse
        self.spares: dict[Request, list[torch.Tensor]] = {}
        self.reuses = 0

    def take(self, backend: Backend, sizes: list[Request], stream: Any) -> list[torch.Tensor]:
        """A buffer per request (a byte count or a geometry, ``_device.Request``): a
        spare made for an equal request that nothing references any more, else a fresh
        one from ``stream``'s pool (allocated together). Reuse is safe in stream order:
        the H2D that refills a spare waits for the compute stream, behind every kernel
        that read it."""
        if not self.spares:  # no reuse, or none to reuse yet
            return backend.alloc(sizes, stream)
        out: list[torch.Tensor | None] = []
        fresh: list[int] = []
        for nbytes in sizes:
            buf = None
            spares = self.spares.get(nbytes)
            while spares:
                candidate = spares.pop()
                if _storage_use_count(candidate) <= 2:  # ours (+ the storage's wrapper)
                    self.reuses += 1
                    buf = candidate
                    break
            if buf is None:
                fresh.append(len(out))
            out.append(buf)
        if fresh:
            new = backend.alloc([sizes[i] for i in fresh], stream)
            for i, buf in zip(fresh, new):
                out[i] = buf
        return out

    def give(self, buffer: torch.Tensor, request: Request) -> None:
        """A group is done with ``buffer`` (made for ``request``): keep it as a spare
        when reusing."""
        if self.reuse:
            self.spares.setdefault(request, []).append(buffer)

    def clear(self) -> None:
        """The backward is over: free every spare."""
        self.spares.clear()
