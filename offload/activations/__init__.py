"""Activation offloading: :class:`ActivationOffloader` and :func:`no_offload` (the front,
``_offloader``), driven by one step per forward (``_step``) over groups of saved tensors
(``_group``, ``_saves``, ``_handles``); ``_auto`` holds the ``"auto"`` policy."""

from __future__ import annotations

from offload.activations._offloader import ActivationOffloader, no_offload

__all__ = ["ActivationOffloader", "no_offload"]
