"""The planner's search: the lever of each layer that meets a memory budget at the least
predicted step time (:func:`optimize`, :func:`candidates`).

It considers the plans of the form "the first ``k`` layers offloaded, the next ``o``
selective_offload, the next ``c`` checkpointed (all of them plain ``checkpoint`` or all
``checkpoint_offload``), the next ``s`` selective (all plain ``selective`` or all
``selective_offload_inputs``), the rest kept": the offloaded layers come first (the
release rule keeps the last groups resident, so early layers hide their copies best),
and the recompute levers are ordered by what they keep (least first), which minimises
every backward's peak for layers of equal size. The checkpointed or selective layers
may reach the last layer, whose inputs then leave the device before the head (the
levers of :data:`~offload._planner.levers.NOT_LAST` never take it). For each ``k``,
``o``, ``c`` and the two kinds it takes the fewest selective layers that fit (a binary
search), so it evaluates O(L^3 log L) plans, each in O(L); beyond
:attr:`PlannerSettings.full_search` layers it tries the counts on a stride first and then
every count near the fastest families found, which keeps the number of plans about that
of that many layers. The fastest few of them (:attr:`PlannerSettings.polished`, each more than
two layers from the others) are then improved by hill climbing (one layer's lever
changed, or two neighbours swapped, while the predicted time drops within the budget),
which reaches the plans outside that form that mixed layer kinds favour. The tests
check the result against brute force over every assignment on small models.

The single-lever plans (:func:`single_levers`: nothing, offloading all that hides,
selective or full recompute of every layer, full recompute with offloaded inputs) are
always among the candidates when they fit: :mod:`~offload._planner.verify` measures the
best of them against the choice, so that a plan is never slower than the obvious one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from offload._planner.costs import PlanCosts
from offload._planner.levers import LEVERS, NOT_LAST, OFFLOADED, check_levers, summary
from offload._planner.settings import DEFAULT_PLANNER, PlannerSettings

__all__ = [
    "candidates",
    "compression",
    "optimize",
    "single_levers",
]


def compression(
    costs: PlanCosts, levers: Sequence[str], settings: PlannerSettings = DEFAULT_PLANNER
) -> list[bool]:
    """Which offloaded layers of ``levers`` travel compressed (``costs`` measured with
    ``compress``): none at first, then, one layer at a time, every layer whose
    compression lowers the predicted step by more than ``settings.compress_gain``, until
    none does. Compression is lossy: a layer whose copies hide anyway travels exactly."""
    L = costs.num_layers
    mask = [False] * L
    best = costs.seconds(levers, mask)
    improved = True
    while improved:
        improved = False
        for i, lever in enumerate(levers):
            if mask[i] or lever not in OFFLOADED:
                continue
            trial = mask[:i] + [True] + mask[i + 1 :]
            t = costs.seconds(levers, trial)
            if t < best * (1.0 - settings.compress_gain):
                mask, best, improved = trial, t, True
    return mask


def single_levers(
    costs: PlanCosts, levers: Sequence[str] = LEVERS, settings: PlannerSettings = DEFAULT_PLANNER
) -> list[tuple[str, list[str]]]:
    """The plans of one lever, as ``(name, levers)``, those of ``levers`` only:
    ``"keep"`` (nothing), ``"offload"`` (the longest prefix of layers whose copies the
    link hides within ``settings.hidden_slowdown``; absent when not even one layer's does),
    ``"selective"``, ``"checkpoint"`` (every layer) and ``"checkpoint_offload"``
    (every layer but the last, which is checkpointed: its inputs stay, so that no
    backward waits for a reload; the search's plans may offload them too)."""
    allowed = set(check_levers(levers, "levers")) | {"keep"}
    L = costs.num_layers
    out: list[tuple[str, list[str]]] = [("keep", ["keep"] * L)]
    if "offload" in allowed and L > 1:
        limit = costs.seconds(["keep"] * L) * (1.0 + settings.hidden_slowdown)
        hides = [k for k in range(1, L) if costs.seconds(_family(L, k, 0, 0, 0)) <= limit]
        if hides:
            out.append(("offload", _family(L, max(hides), 0, 0, 0)))
    for lever in ("selective", "checkpoint"):
        if lever in allowed:
            out.append((lever, [lever] * L))
    if "checkpoint_offload" in allowed and L > 1:
        last = "checkpoint" if "checkpoint" in allowed else "keep"
        out.append(("checkpoint_offload", ["checkpoint_offload"] * (L - 1) + [last]))
    return out


def _family(
    L: int, k: int, o: int, c: int, s: int, ckpt: str = "checkpoint", sel: str = "selective"
) -> list[str]:
    return (
        ["offload"] * k
        + ["selective_offload"] * o
        + [ckpt] * c
        + [sel] * s
        + ["keep"] * (L - k - o - c - s)
    )


def optimize(
    costs: PlanCosts,
    budget_bytes: float,
    levers: Sequence[str] = LEVERS,
    settings: PlannerSettings = DEFAULT_PLANNER,
) -> list[str]:
    """The lever of each layer that meets ``budget_bytes`` at the least predicted time
    (the first of :func:`candidates`).

    Args:
        costs: the cost model (:class:`PlanCosts`).
        budget_bytes: the largest predicted activation peak allowed, in bytes.
        levers: the levers the search may use (``"keep"`` is always allowed).
            Default: all of :data:`LEVERS`.
        settings: the search's tuning (:class:`PlannerSettings`).

    Returns:
        One lever name per layer.

    Raises:
        ValueError: no plan of the searched form fits; the message gives the smallest
            budget that does and the plan that reaches it.
    """
    return candidates(costs, budget_bytes, levers, settings)[0][1]


def candidates(
    costs: PlanCosts,
    budget_bytes: float,
    levers: Sequence[str] = LEVERS,
    settings: PlannerSettings = DEFAULT_PLANNER,
) -> list[tuple[float, list[str]]]:
    """Every plan of the searched form whose predicted peak fits ``budget_bytes`` (for
    each ``k`` offloaded, ``o`` selective_offload, ``c`` checkpointed, checkpoint kind
    and selective kind, the fewest selective layers that fit), as ``(predicted
    seconds, levers)``, fastest first (equal times: fewer link bytes, then the smaller
    predicted peak, first). Same arguments and errors as :func:`optimize`."""
    allowed = set(check_levers(levers, "levers")) | {"keep"}
    L = costs.num_layers
    kinds = [x for x in ("checkpoint", "checkpoint_offload") if x in allowed] or ["checkpoint"]
    sels: list[str] = [x for x in ("selective", "selective_offload_inputs") if x in allowed]
    sels = sels or ["keep"]
    found: list[tuple[float, list[str]]] = []
    smallest: tuple[float, list[str]] | None = None
    # (k, o, c, checkpoint kind, selective kind) -> seconds of the family's plan
    families: dict[tuple[int, int, int, str, str], float] = {}
    seen: set[tuple[str, ...]] = set()

    def family(k: int, o: int, c: int, ckpt: str, sel: str) -> None:
        """The fastest plan of the family (fewest selective layers that fit), if any."""
        nonlocal smallest
        if (k, o, c, ckpt, sel) in families:
            return
        top = L - k - o - c if sel != "keep" else 0
        # memory does not grow as layers go from kept to selective: take the first count
        # that fits (binary search), the cheapest of this family
        most = _family(L, k, o, c, top, ckpt, sel)
        mem = costs.memory(most)
        if mem > budget_bytes:
            families[(k, o, c, ckpt, sel)] = float("inf")
            if smallest is None or mem < smallest[0]:
                smallest = (mem, most)
            return
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi) // 2
            if costs.memory(_family(L, k, o, c, mid, ckpt, sel)) <= budget_bytes:
                hi = mid
            else:
                lo = mid + 1
        candidate = _family(L, k, o, c, lo, ckpt, sel)
        seconds = costs.seconds(candidate)
        families[(k, o, c, ckpt, sel)] = seconds
        if tuple(candidate) not in seen:  # no selective layer: the same for both kinds
            seen.add(tuple(candidate))
            found.append((seconds, candidate))

    def counts(n: int, step: int, around: int | None = None) -> list[int]:
        """0..n-1 every ``step`` (the last one too), or every value within ``step`` of
        ``around``."""
        if n <= 0:
            return [0]
        if around is not None:
            return list(range(max(0, around - step), min(n, around + step + 1)))
        return sorted({*range(0, n, step), n - 1})

    def search(step: int, near: tuple[int, int, int, str, str] | None = None) -> None:
        nk, no, nc = (near[0], near[1], near[2]) if near is not None else (None, None, None)
        # offload and selective_offload never take the last layer (NOT_LAST): k + o < L
        for k in counts(L, step, nk) if "offload" in allowed else [0]:
            for o in counts(L - k, step, no) if "selective_offload" in allowed else [0]:
                for ckpt in kinds if near is None else [near[3]]:
                    cs = counts(L - k - o + 1, step, nc) if ckpt in allowed else [0]
                    for c in cs:
                        if c == 0 and ckpt != kinds[0]:
                            continue  # the same plans as with the first kind
                        for sel in sels if near is None else [near[4]]:
                            family(k, o, c, ckpt, sel)

    # Every family up to full_search layers; beyond, the counts on a stride first (about
    # full_search values each), then every count near the fastest families found.
    stride = -(-L // settings.full_search)
    search(stride)
    if stride > 1:
        best = sorted((t, f) for f, t in families.items() if t != float("inf"))
        for _, f in best[: settings.refined]:
            search(stride, f)
    for _, single in single_levers(costs, sorted(allowed), settings):
        mem = costs.memory(single)
        if mem <= budget_bytes and tuple(single) not in seen:
            seen.add(tuple(single))
            found.append((costs.seconds(single), single))
        elif mem > budget_bytes and (smallest is None or mem < smallest[0]):
            smallest = (mem, single)
    if not found:
        assert smallest is not None
        raise ValueError(
            f"budget={budget_bytes / 2**30:.3f} GiB is below the smallest feasible "
            f"activation peak, {smallest[0] / 2**30:.3f} GiB (levers "
            f"{summary(smallest[1])}); raise the budget or allow more levers"
        )
    key = _ranking(costs)
    found.sort(key=key)
    # then improve the best few one layer at a time (plans outside the family: an
    # input-offloaded checkpoint before a selective_offload layer, a plain checkpoint
    # between offloaded ones); improved plans that are new join the list
    for levers in _distinct(found, settings.polished):
        better = _polish(costs, budget_bytes, levers, sorted(allowed), key)
        if tuple(better) not in seen:
            seen.add(tuple(better))
            found.append((costs.seconds(better), better))
    found.sort(key=key)
    return found


def _distinct(found: list[tuple[float, list[str]]], n: int) -> list[list[str]]:
    """The first ``n`` plans of ``found`` that differ from each other in more than two
    layers: a plan within two layers of a better-ranked one is a move or two of the hill
    climbing from it, and would take a start from a plan of another shape."""
    starts: list[list[str]] = []
    for _, levers in found:
        if len(starts) == n:
            break
        if all(sum(a != b for a, b in zip(levers, s)) > 2 for s in starts):
            starts.append(levers)
    return starts


def _ranking(costs: PlanCosts) -> Callable[[tuple[float, list[str]]], tuple[float, ...]]:
    """Sort key of ``(seconds, levers)``: faster first; equal predicted times: fewer
    bytes on the link (a copy predicted to hide still costs host time), then the smaller
    predicted peak (more room for the measured one), then the search order (stable)."""

    def key(item: tuple[float, list[str]]) -> tuple[float, ...]:
        return (item[0], costs.link_total(item[1]), costs.memory(item[1]))

    return key


def _polish(
    costs: PlanCosts,
    budget_bytes: float,
    levers: list[str],
    allowed: Sequence[str],
    key: Callable[[tuple[float, list[str]]], tuple[float, ...]],
) -> list[str]:
    """Hill climbing from ``levers``: change the lever of one layer (or of two adjacent
    layers, swapping them) while that ranks the plan better (:func:`_ranking`) within
    ``budget_bytes``; stops at a plan no such move improves (the last layer never takes
    a lever of :data:`~offload._planner.levers.NOT_LAST`). O(L * levers) plans a move."""
    L = len(levers)
    current = list(levers)
    best = key((costs.seconds(current), current))
    improved = True
    while improved:
        improved = False
        moves: list[list[str]] = []
        for i in range(L):
            for lever in allowed:
                if lever != current[i] and not (i == L - 1 and lever in NOT_LAST):
                    moves.append(current[:i] + [lever] + current[i + 1 :])
        for i in range(L - 1):
            if current[i] != current[i + 1] and not (i == L - 2 and current[i] in NOT_LAST):
                moves.append(current[:i] + [current[i + 1], current[i]] + current[i + 2 :])
        for move in moves:
            if costs.memory(move) > budget_bytes:
                continue
            rank = key((costs.seconds(move), move))
            if rank < best:
                best, current, improved = rank, move, True
    return current
