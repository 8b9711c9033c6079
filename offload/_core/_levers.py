"""Which models have a lever outside their layers installed by the user (the LM head and
loss in slices, ``offload.sliced_head_loss``), for the runtime to read without
importing the levers: ``offload/_recompute/_head.py`` registers and unregisters, and
``"auto"`` reads it (Note [memory short] in ``offload/activations/_auto/_short.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from torch import nn

__all__ = ["head_lever_over", "register_head", "unregister_head"]

_LOCK = threading.Lock()
#: the causal LMs whose head and loss are computed in slices now
_HEADS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def register_head(model: nn.Module) -> None:
    """``model``'s head and loss are computed in slices from now on."""
    with _LOCK:
        _HEADS.add(model)


def unregister_head(model: nn.Module) -> None:
    """... no longer (idempotent)."""
    with _LOCK:
        _HEADS.discard(model)


def head_lever_over(layers: Sequence[nn.Module]) -> bool:
    """Whether a model whose head and loss are computed in slices holds ``layers``' first
    layer (one walk over each such model's modules)."""
    if not layers:
        return False
    first = layers[0]
    with _LOCK:
        models = list(_HEADS)
    return any(any(m is first for m in model.modules()) for model in models)
