"""Reporting: what offloading measured (:func:`offload.profile_step`'s
:class:`MemoryProfile` and :class:`Timeline`), its rich rendering and matplotlib plots.
Nothing below this package imports it; it registers its rendering with
:mod:`offload.stats` (Note [rendering] there)."""

from __future__ import annotations

from offload import stats as _stats
from offload._core._units import format_bytes
from offload.profiling import _render
from offload.profiling._data import (
    CopySpan,
    LayerSpan,
    MemoryProfile,
    MemorySample,
    Timeline,
)
from offload.stats import KEEP_REASONS, LayerStats, OffloadStats

_stats.register_renderer(_render)

__all__ = [
    "KEEP_REASONS",
    "CopySpan",
    "LayerSpan",
    "LayerStats",
    "MemoryProfile",
    "MemorySample",
    "OffloadStats",
    "Timeline",
    "format_bytes",
]
