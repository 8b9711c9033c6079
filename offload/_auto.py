"""``offload_layers="auto"``: offload as many layers as the link hides behind compute.

The first forward of each input shape runs with nothing offloaded and measures, per
layer call, its forward and backward time and the bytes it would offload; the host link
bandwidth is measured once per device. From those numbers :func:`predict_step` replays
the schedule of ``# Note [release order]`` (one copy stream per direction, copies
serialised on it, the compute stream waiting where the note says it waits) and
:func:`choose` takes the longest prefix of layers whose predicted step stays within
``max_slowdown`` of the step without offloading. Prefixes, because the release rule
keeps the last ``L - k`` groups resident: the first layers are the ones whose copies have
the most compute to hide behind.

Without an accelerator there is no overlap to measure and no device memory to save:
"auto" then selects like "all" (every call but the last), so the CPU path runs the
scheduling the GPU would run with every layer offloaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from offload._measure import link_bandwidth
from offload._plan import make_plan

__all__ = ["AutoDecision", "LayerCost", "choose", "link_bandwidth", "predict_step"]


#: Host seconds that offloading adds per copy (pack, release, reload, unpack, free in
#: Python): fitted on an H200 host on tiny48 (48 small layers, launch-bound), where
#: offloading every layer added about 90 ms for 423 copies a step. It only costs step
#: time where the host, not the device, sets the pace (see :func:`predict_step`).
HOST_SECONDS_PER_COPY = 2.0e-4


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one layer call costs: seconds of forward and backward compute on the
    device, the bytes offloading it would send each way, the host seconds spent issuing
    its forward and backward, and the number of copies offloading it would make."""

    forward_s: float
    backward_s: float
    nbytes: int
    host_forward_s: float = 0.0
    host_backward_s: float = 0.0
    copies: int = 0

    def forward(self, offloaded: bool) -> float:
        """The layer's forward time: device time, or the host's when the host (with
        the offloader's extra work) is slower."""
        extra = HOST_SECONDS_PER_COPY * self.copies / 2 if offloaded else 0.0
        return max(self.forward_s, self.host_forward_s + extra)

    def backward(self, offloaded: bool) -> float:
        extra = HOST_SECONDS_PER_COPY * self.copies / 2 if offloaded else 0.0
        return max(self.backward_s, self.host_backward_s + extra)


@dataclasses.dataclass
class AutoDecision:
    """What "auto" chose for one input shape, and why (JSON-ready via ``to_dict``)."""

    offloaded: list[int]
    num_groups: int
    predicted_ratio: float
    base_seconds: float
    next_ratio: float | None  # predicted ratio with one more layer offloaded
    d2h_gbps: float
    h2d_gbps: float
    costs: list[LayerCost]
    reason: str
    gap_s: float = 0.0  # device seconds between the last layer's forward and its backward

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predict_step(
    costs: Sequence[LayerCost],
    offloaded: Sequence[int],
    d2h_bps: float,
    h2d_bps: float,
    prefetch_layers: int | None = None,
    gap_s: float = 0.0,
) -> float:
    """Predicted seconds of one forward + backward with ``offloaded`` groups.

    ``gap_s`` is the device time between the end of the last layer's forward and the
    start of its backward (what the model computes after its layers: final norm, head,
    loss, and their backward): copies keep running through it.

    Each layer takes the longer of its device time and its host time (plus
    :data:`HOST_SECONDS_PER_COPY` per copy when offloaded): a launch-bound layer is paced
    by the host. Forward: a group's D2H starts when its layer starts (copies begin at
    save time) and
    the D2H stream is free, and ends no earlier than the layer; the compute stream waits
    for it at the group's release point. Backward: a group's H2D starts when the backward
    of its reload layer starts and the H2D stream is free; the group's own backward waits
    for it. Both directions run at once (the link is full duplex).
    """
    L = len(costs)
    plan = make_plan(L, sorted(offloaded), prefetch_layers)
    t = 0.0
    d2h_free = 0.0
    d2h_done: dict[int, float] = {}
    for i in range(L):
        for s in plan.release_at.get(i, ()):
            t = max(t, d2h_done[s])
        start = t
        t += costs[i].forward(i in plan.offloaded)
        if i in plan.offloaded:
            d2h_free = max(d2h_free, start) + costs[i].nbytes / d2h_bps
            d2h_done[i] = max(d2h_free, t)
    released = {g for groups in plan.release_at.values() for g in groups}
    for s in plan.offloaded - released:
        t = max(t, d2h_done[s])  # released when the forward ends
    t += gap_s
    h2d_free = 0.0
    h2d_done: dict[int, float] = {}
    for q in range(L - 1, -1, -1):
        for s in plan.reload_at.get(q, ()):
            h2d_free = max(h2d_free, t) + costs[s].nbytes / h2d_bps
            h2d_done[s] = h2d_free
        if q in plan.offloaded:
            t = max(t, h2d_done.get(q, t))
        t += costs[q].backward(q in plan.offloaded)
    return t


def choose(
    costs: Sequence[LayerCost],
    d2h_bps: float,
    h2d_bps: float,
    max_slowdown: float,
    prefetch_layers: int | None = None,
    gap_s: float = 0.0,
) -> AutoDecision:
    """The longest prefix of layers (never the last) whose predicted step is within
    ``1 + max_slowdown`` of the step without offloading (``gap_s``: see
    :func:`predict_step`; it counts in the step, so in what the slowdown is relative to)."""
    L = len(costs)
    base = sum(c.forward(False) + c.backward(False) for c in costs) + gap_s
    limit = base * (1.0 + max_slowdown)
    best_k, best_ratio, next_ratio = 0, 1.0, None
    for k in range(1, L):
        if costs[k - 1].nbytes == 0:
            continue  # nothing to gain from this layer; it would not move anything
        predicted = predict_step(costs, range(k), d2h_bps, h2d_bps, prefetch_layers, gap_s)
        if predicted <= limit:
            best_k, best_ratio = k, predicted / base if base else 1.0
        else:
            next_ratio = predicted / base if base else None
            break
    chosen = list(range(best_k))
    saved = sum(costs[i].nbytes for i in chosen)
    if L <= 1:
        reason = "one layer call per forward: the last call is never offloaded"
    elif best_k == L - 1:
        reason = (
            f"offloading {best_k} of {L} layer calls (all but the last): the link hides "
            f"every copy within {max_slowdown:.0%} (predicted {best_ratio:.3f}x)"
        )
    else:
        extra = ""
        if next_ratio is not None:
            stall_ms = (next_ratio - 1.0) * base * 1e3 / max(1, best_k + 1)
            extra = (
                f"; {best_k + 1} would predict {next_ratio:.3f}x, about {stall_ms:.1f} ms "
                f"of stall per offloaded layer"
            )
        reason = (
            f"offloading {best_k} of {L} layer calls ({saved / 2**30:.2f} GiB): more would "
            f"exceed max_slowdown={max_slowdown:.0%}{extra}"
        )
    return AutoDecision(
        offloaded=chosen,
        num_groups=L,
        predicted_ratio=best_ratio,
        base_seconds=base,
        next_ratio=next_ratio,
        d2h_gbps=d2h_bps / 1e9,
        h2d_gbps=h2d_bps / 1e9,
        costs=list(costs),
        reason=reason,
        gap_s=gap_s,
    )
