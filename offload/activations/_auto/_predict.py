"""``offload_layers="auto"``: how many layers the link hides, and how many memory needs.

From per-layer costs (forward and backward time, the bytes offloading sends each way,
measured by ``offload/activations/_auto/_probe.py`` and carried across input sizes by
``offload/activations/_auto/_fit.py``) :func:`predict_step` replays the schedule of ``# Note [release
order]`` (one copy stream per direction, copies serialised on it, the compute stream
waiting where the note says it waits) and :func:`choose` takes the longest prefix of
layers whose predicted step stays within ``max_slowdown`` of the step without
offloading. Prefixes, because the release rule keeps the last ``L - k`` groups
resident: the first layers are the ones whose copies have the most compute to hide
behind. Memory comes first: :func:`memory_floor` gives the fewest layers whose
offloading keeps the step's predicted peak within the device memory, and :func:`choose`
never offloads fewer. ``offload/activations/_auto/_policy.py`` holds the policy that measures,
verifies and re-decides.

Without an accelerator there is no overlap to measure and no device memory to save:
"auto" then selects like "all" (every call but the last), so the CPU path runs the
scheduling the GPU would run with every layer offloaded.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from offload._core._measure import link_bandwidth
from offload.activations._auto._settings import DEFAULT_AUTO
from offload.activations._schedule import make_plan

__all__ = [
    "AutoDecision",
    "LayerCost",
    "choose",
    "link_bandwidth",
    "memory_floor",
    "predict_step",
]


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

    def forward(
        self, offloaded: bool, per_copy: float = DEFAULT_AUTO.host_seconds_per_copy
    ) -> float:
        """The layer's forward time: device time, or the host's when the host (with
        the offloader's extra work, ``per_copy`` host seconds per copy, half of them in
        the forward) is slower."""
        extra = per_copy * self.copies / 2 if offloaded else 0.0
        return max(self.forward_s, self.host_forward_s + extra)

    def backward(
        self, offloaded: bool, per_copy: float = DEFAULT_AUTO.host_seconds_per_copy
    ) -> float:
        extra = per_copy * self.copies / 2 if offloaded else 0.0
        return max(self.backward_s, self.host_backward_s + extra)


@dataclasses.dataclass
class AutoDecision:
    """What "auto" chose for one input size, and why (JSON-ready via ``to_dict``).

    ``time_offloaded``: the layers the link hides within ``max_slowdown`` (before any
    back-off); ``memory_offloaded``: the fewest layers memory needs (0 when memory
    needs none or is unknown); ``memory_reason``: set when memory forced more
    offloading than the link hides; ``backoff``: layers taken off the link's choice
    after a measured slowdown (negative: layers added by a measured step up)."""

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
    time_offloaded: int = 0
    memory_offloaded: int = 0
    memory_reason: str | None = None
    backoff: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (``dataclasses.asdict``'s result, built without its
        deep copy: every step at a new size asks for one)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["offloaded"] = list(self.offloaded)
        out["costs"] = [dict(vars(c)) for c in self.costs]
        return out


def memory_floor(freed: Sequence[float], peak_all: float, limit: float) -> int:
    """The fewest leading layers to offload so that the step's predicted peak stays
    within ``limit`` bytes.

    ``peak_all`` is the predicted peak with every call but the last offloaded (``"all"``)
    and ``freed[i]`` the device bytes offloading call ``i`` frees: with the first ``k``
    offloaded, calls ``k .. L-2`` keep theirs, so the peak is ``peak_all + sum(freed[k:L-1])``
    (the release rule keeps every call that is not offloaded resident until its backward,
    and the forward's end is where the most are). When even ``"all"`` is predicted not
    to fit, that is ``L - 1``: nothing offloads more."""
    L = len(freed)
    if L <= 1:
        return 0
    kept = 0.0
    # walk k down from L - 1: each step keeps one more call resident
    for k in range(L - 1, -1, -1):
        if k < L - 1:
            kept += freed[k]
        if peak_all + kept > limit:
            return min(L - 1, k + 1)
    return 0


def predict_step(
    costs: Sequence[LayerCost],
    offloaded: Sequence[int],
    d2h_bps: float,
    h2d_bps: float,
    prefetch_layers: int | None = None,
    gap_s: float = 0.0,
    per_copy: float = DEFAULT_AUTO.host_seconds_per_copy,
) -> float:
    """Predicted seconds of one forward + backward with ``offloaded`` groups.

    ``gap_s`` is the device time between the end of the last layer's forward and the
    start of its backward (what the model computes after its layers: final norm, head,
    loss, and their backward): copies keep running through it.

    Each layer takes the longer of its device time and its host time (plus
    ``per_copy`` seconds per copy when offloaded:
    :attr:`~offload.activations._auto._settings.AutoSettings.host_seconds_per_copy`): a launch-bound layer is paced
    by the host. Forward: a group's D2H starts when its layer starts (copies begin at
    save time) and
    the D2H stream is free, and ends no earlier than the layer; the compute stream waits
    for it at the group's release point. Backward: a group's H2D starts when the backward
    of its reload layer starts and the H2D stream is free; the group's own backward waits
    for it. Both directions run at once (the link is full duplex).
    """
    L = len(costs)
    plan, released = _plan_of(L, tuple(sorted(offloaded)), prefetch_layers)
    t = 0.0
    d2h_free = 0.0
    d2h_done: dict[int, float] = {}
    for i in range(L):
        for s in plan.release_at.get(i, ()):
            t = max(t, d2h_done[s])
        start = t
        t += costs[i].forward(i in plan.offloaded, per_copy)
        if i in plan.offloaded:
            d2h_free = max(d2h_free, start) + costs[i].nbytes / d2h_bps
            d2h_done[i] = max(d2h_free, t)
    for s in plan.offloaded - released:
        t = max(t, d2h_done[s])  # the last call: released at its close, before the gap
    t += gap_s
    h2d_free = 0.0
    h2d_done: dict[int, float] = {}
    for q in range(L - 1, -1, -1):
        for s in plan.reload_at.get(q, ()):
            h2d_free = max(h2d_free, t) + costs[s].nbytes / h2d_bps
            h2d_done[s] = h2d_free
        if q in plan.offloaded:
            t = max(t, h2d_done.get(q, t))
        t += costs[q].backward(q in plan.offloaded, per_copy)
    return t


@functools.lru_cache(maxsize=512)
def _plan_of(
    num_groups: int, offloaded: tuple[int, ...], prefetch_layers: int | None
) -> tuple[Any, frozenset[int]]:
    """The schedule :func:`predict_step` simulates and the groups it releases before the
    last call (pure: shared between the predictions of every size)."""
    plan = make_plan(num_groups, offloaded, prefetch_layers)
    return plan, frozenset(g for groups in plan.release_at.values() for g in groups)


def choose(
    costs: Sequence[LayerCost],
    d2h_bps: float,
    h2d_bps: float,
    max_slowdown: float,
    prefetch_layers: int | None = None,
    gap_s: float = 0.0,
    *,
    min_offloaded: int = 0,
    backoff: int = 0,
    memory_note: str = "",
    per_copy: float = DEFAULT_AUTO.host_seconds_per_copy,
) -> AutoDecision:
    """The longest prefix of layers (never the last) whose predicted step is within
    ``1 + max_slowdown`` of the step without offloading (``gap_s``: see
    :func:`predict_step`; it counts in the step, so in what the slowdown is relative to),
    less ``backoff`` layers (more where it is negative, never the last), and never fewer
    than ``min_offloaded`` (what memory needs: :func:`memory_floor`; ``memory_note``
    says why, for the reason); ``per_copy``: as in :func:`predict_step`."""
    L = len(costs)
    base = sum(c.forward(False) + c.backward(False) for c in costs) + gap_s
    limit = base * (1.0 + max_slowdown)
    best_k, best_ratio, next_ratio = 0, 1.0, None
    for k in range(1, L):
        if costs[k - 1].nbytes == 0:
            continue  # nothing to gain from this layer; it would not move anything
        predicted = predict_step(
            costs, range(k), d2h_bps, h2d_bps, prefetch_layers, gap_s, per_copy
        )
        if predicted <= limit:
            best_k, best_ratio = k, predicted / base if base else 1.0
        else:
            next_ratio = predicted / base if base else None
            break
    time_k = best_k
    floor = min(max(0, min_offloaded), max(0, L - 1))
    k = max(floor, min(max(0, L - 1), max(0, time_k - backoff)))
    if k != best_k:
        predicted = predict_step(
            costs, range(k), d2h_bps, h2d_bps, prefetch_layers, gap_s, per_copy
        )
        best_ratio = predicted / base if base else 1.0
        if k + 1 < L:
            after = predict_step(
                costs, range(k + 1), d2h_bps, h2d_bps, prefetch_layers, gap_s, per_copy
            )
            next_ratio = after / base if base else None
        else:
            next_ratio = None
    best_k = k
    chosen = list(range(best_k))
    saved = sum(costs[i].nbytes for i in chosen)
    memory_reason = None
    if floor > max(0, time_k - backoff):
        memory_reason = (
            f"memory: offloading {best_k} of {L} layer calls, more than the "
            f"{max(0, time_k - backoff)} the link hides within {max_slowdown:.0%}"
            f"{': ' + memory_note if memory_note else ''} (predicted {best_ratio:.3f}x)"
        )
        reason = memory_reason
    elif L <= 1:
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
        if backoff > 0 and best_k < time_k:
            extra += f"; {time_k - best_k} fewer than predicted after a measured slowdown"
        elif backoff < 0 and best_k > time_k:
            extra += (
                f"; {best_k - time_k} more than predicted: a step up, measured against "
                f"steps without offloading"
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
        time_offloaded=time_k,
        memory_offloaded=floor,
        memory_reason=memory_reason,
        backoff=time_k - best_k if memory_reason is None else 0,
    )
