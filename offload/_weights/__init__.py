"""The implementation of :class:`offload.WeightOffloader` (``offload/weights.py``), one
concept per module: ``_init`` (checks), ``_storage`` (per parameter), ``_residency``
(per layer: Note [weight residency]), ``_hooks``, ``_host_grads``, ``_state_dict``,
``_optim``, ``_lifecycle``, ``_manual`` (``get_cpu_offload_context``'s weights)."""

from __future__ import annotations

from typing import Any

__all__ = ["manual_weight_context"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: ``_manual`` builds on the public front, which imports this
    # package's modules.
    if name == "manual_weight_context":
        from offload._weights._manual import manual_weight_context

        return manual_weight_context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
