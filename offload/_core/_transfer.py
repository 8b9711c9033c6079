"""One span of one device storage copied to a host block, and back.

Shared by activation offloading (Note [release order]) and ``offload.checkpoint`` (Note
[checkpoint inputs]): the span, the host block, the version at copy time, the events
that order the copies, and the in-place poison its readers raise."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload._core._host_pool import HostBlock

__all__ = ["HostCopy"]


class HostCopy:
    """Bytes ``[start, end)`` of one device storage, in one host block.

    ``owner`` is the index of the group whose D2H event covers the copy (an index, not
    the group: a group lists its copies, and a back reference would be a cycle that
    only the garbage collector frees, with the device buffers it holds); ``-1`` for a
    checkpointed call's copy, whose event is ``d2h_event``.

    Args:
        owner: the index of the group that made it (``-1``: none).
        start: first byte of the span in the storage.
        end: one past its last byte.
        version: the storage's tensor version when the copy was made (``-1``: several).
        host: the host block the bytes go to.
        codec: ``compress="fp8"``: the dtype the span is quantized from. Default ``None``.
        storage: the device storage, watched weakly. Default ``None``.
        storage_nbytes: that storage's size. Default ``0``.
    """

    __slots__ = (
        "owner",
        "start",
        "end",
        "version",
        "host",
        "refs",
        "buffer",
        "d2h_event",
        "reload_event",
        "stream",
        "waited",
        "holders",
        "users",
        "poison",
        "ref",
        "storage_nbytes",
        "codec",
        "spec",
        "host_view",
        "late",
    )

    def __init__(
        self,
        owner: int,
        start: int,
        end: int,
        version: int,
        host: HostBlock,
        codec: torch.dtype | None = None,
        storage: torch.UntypedStorage | None = None,
        storage_nbytes: int = 0,
    ):
        self.owner = owner
        self.start = start
        self.end = end
        self.version = version
        self.host: HostBlock | None = host
        self.refs = 0  # live handles
        self.buffer: torch.Tensor | None = None  # reloaded device bytes
        self.d2h_event: Any = None
        self.reload_event: Any = None
        self.stream: Any = None
        self.waited = False
        self.holders = 0  # groups that have not yet dropped the reloaded buffer
        self.users = 0  # groups whose handles point at this copy
        self.poison: str | None = None
        #: the device storage, while it lives (None for a bucket: its members have theirs)
        self.ref = None if storage is None else StorageWeakRef(storage)
        self.storage_nbytes = storage_nbytes
        #: compress="fp8": the dtype the span is quantized from (its host bytes are the
        #: packed form of offload/_core/_compress.py); None: the span's bytes, exactly
        self.codec = codec
        #: (dtype, size, stride) when the span is the whole storage of a contiguous
        #: tensor of that geometry (the common case): its host bytes are written and read
        #: through ``host_view`` (that geometry over the host block) and it is reloaded
        #: into a buffer of that geometry, which its handles of that geometry return as
        #: they are (no byte views). None: byte copies (uint8 host view and buffers).
        self.spec: tuple[torch.dtype, torch.Size, tuple[int, ...]] | None = None
        #: the host block as the copies write and read it: ``spec``'s geometry, else its
        #: ``length`` bytes (``uint8``); a view the pool caches (``HostBlock.typed``).
        #: None once the block is returned.
        self.host_view: torch.Tensor | None = None
        #: a save made before its group opened (between layer calls) points at it: its
        #: backward runs after the group's, so the group's drop leaves the buffer to the
        #: copy's last handle or the previous group's drop (Note [release order], 6)
        self.late = False

    @property
    def nbytes(self) -> int:
        return self.end - self.start
