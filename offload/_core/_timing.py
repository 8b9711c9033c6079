"""Turn the timing records of ``timing=True`` into seconds per layer."""

from __future__ import annotations

from typing import Any

__all__ = ["resolve"]


def resolve(records: list[tuple[Any, list[tuple[Any, ...]]]]) -> None:
    """Fill ``d2h_seconds``, ``h2d_seconds`` and ``stall_seconds`` of each group's
    :class:`~offload.LayerStats` from its records: ``(kind, seconds)`` measured on the
    host (synchronous path) or ``(kind, start_event, end_event)`` on a device stream.
    Waits on the host for the recorded events."""
    for stats, times in records:
        sums = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0}
        for record in times:
            if len(record) == 2:
                sums[record[0]] += record[1]
            else:
                kind, start, end = record
                end.synchronize()
                sums[kind] += start.elapsed_time(end) / 1e3
        stats.d2h_seconds = sums["d2h"]
        stats.h2d_seconds = sums["h2d"]
        stats.stall_seconds = sums["stall"]
