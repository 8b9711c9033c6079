"""The saved-tensor handles that need no scheduler: :class:`Kept` (stays on the device,
its version checked at unpack), :class:`Raw` (a non-tensor part, by reference), and
:func:`unpack_hook`, the unpack half of every pair of saved-tensor hooks. The runtime's
other handles (``offload/activations/_handles.py``) build on them; so do recompute and
the planner."""

from __future__ import annotations

from typing import Any

import torch

from offload._core import _dynamo

__all__ = ["Kept", "Raw", "inplace_message", "unpack_hook"]


def inplace_message(t: torch.Tensor, version: int) -> str:
    """Autograd's kind of error for a saved tensor changed in place after saving."""
    return (
        f"one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.dtype}{list(t.shape)}] is at version {t._version}; "
        f"expected version {version} instead (detected by offload: the tensor was saved "
        f"for backward and then changed in place)"
    )


class Kept:
    """A saved tensor that stays on the device."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(inplace_message(t, self.version))
        return t


class Raw:
    """A non-tensor attribute of a flattened subclass, kept by reference."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unpack(self) -> Any:
        return self.obj


def unpack_hook(handle: Any) -> torch.Tensor:
    """The unpack half of the saved-tensor hooks."""
    return handle.unpack()


_dynamo.opaque(unpack_hook)  # never a frame for dynamo (offload/_core/_dynamo.py)
