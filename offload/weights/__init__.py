"""Weight offloading: :class:`WeightOffloader` (the front, ``_front``), one concept per
module: ``_init`` (checks), ``_storage`` (per parameter), ``_residency`` (per layer: Note
[weight residency]), ``_hooks``, ``_host_grads``, ``_state_dict``, ``_optim``,
``_lifecycle``, ``_manual`` (``get_cpu_offload_context``'s weights)."""

from __future__ import annotations

from offload.weights._front import WeightOffloader

__all__ = ["WeightOffloader"]
