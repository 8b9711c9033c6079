"""Which groups of a forward are offloaded, and when each is released and reloaded.

Pure functions of the forward's length and the ``offload_layers`` setting; no tensors,
no state. The schedule itself is explained in ``# Note [release order]``
(``offload/activations/_step.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from offload.config import LayerSelection

__all__ = ["Schedule", "check_selection", "make_plan", "plan_forward", "resolve_selection"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Release and reload points of one forward of ``num_groups`` layer calls.

    ``release_at[r]`` lists the groups released when the forward of call ``r`` starts
    (a group whose release point is ``num_groups``, the last call planned, is released
    at its own close, Note [release order] 3);
    ``reload_at[q]`` lists the groups reloaded when the backward of call ``q`` starts,
    in the order they will be needed. A call past ``num_groups`` (a forward longer than
    planned) follows ``select`` and is released when the forward ends.
    """

    num_groups: int
    offloaded: frozenset[int]
    release_at: dict[int, tuple[int, ...]]
    reload_at: dict[int, tuple[int, ...]]
    select: Callable[[int, Any], bool] = dataclasses.field(
        default=lambda i, m: False, compare=False, repr=False
    )
    #: no call of any forward is offloaded, however many it makes (``offload_layers``
    #: ``0`` or empty, or "auto" choosing none): Note [untracked calls]
    offloads_nothing: bool = False
    #: offloaded calls run recomputed, only their inputs saved (Note [recomputed calls]
    #: in ``offload/activations/_recompute_calls.py``); a subset of ``offloaded``
    recomputed: frozenset[int] = frozenset()


def make_plan(
    num_groups: int,
    offloaded: Sequence[int],
    prefetch_layers: int | None,
    select: Callable[[int, Any], bool] | None = None,
    recomputed: Sequence[int] = (),
) -> Schedule:
    """The schedule of Note [release order] for ``offloaded`` (sorted) of ``num_groups``.

    With L calls and k offloaded groups s_0 < ... < s_{k-1}: group s_j is released when
    call ``max(s_j + 1, L - k + j)`` starts (never more than L - k groups resident, each
    kept as long as that allows) and reloaded when the backward of call
    ``min(L - 1, max(s_j + 1, L - 1 - k + j))`` starts, or of ``s_j + prefetch_layers``.
    ``recomputed`` (a subset of ``offloaded``) run recomputed, their inputs offloaded:
    they hold only their inputs, so the rule counts the other offloaded groups alone
    (k is their number, j their rank) and each recomputed group is released when the
    next call starts and reloaded one call ahead of its backward.
    """
    L = num_groups
    light = frozenset(recomputed)
    rank = {s: j for j, s in enumerate(s for s in offloaded if s not in light)}
    k = len(rank)
    release: dict[int, list[int]] = collections.defaultdict(list)
    reload: dict[int, list[int]] = collections.defaultdict(list)
    for s in offloaded:
        if s in light:  # only its inputs: out at the next call, back one call ahead
            if s + 1 < L:
                release[s + 1].append(s)
            q = min(L - 1, s + (1 if prefetch_layers is None else prefetch_layers))
            reload[q].append(s)
            continue
        j = rank[s]
        r = max(s + 1, L - k + j)
        if r < L:
            release[r].append(s)
        if prefetch_layers is None:
            q = min(L - 1, max(s + 1, L - 1 - k + j))
        else:
            q = min(L - 1, s + prefetch_layers)
        reload[q].append(s)
    chosen = frozenset(offloaded)
    return Schedule(
        num_groups=L,
        offloaded=chosen,
        release_at={r: tuple(g) for r, g in release.items()},
        reload_at={q: tuple(sorted(g, reverse=True)) for q, g in reload.items()},
        select=select or (lambda i, m: i in chosen),
        recomputed=frozenset(recomputed) & chosen,
    )


def resolve_selection(selection: LayerSelection, num_groups: int) -> Callable[[int, Any], bool]:
    """``offload_layers`` as ``select(index, module) -> bool`` for a forward of
    ``num_groups`` calls. ``None`` selects every call but the last one planned, so a call
    past the plan (a longer forward than the last) is never offloaded by default."""
    if selection is None or selection in ("all", "auto"):  # "auto" off the accelerator
        return lambda i, m: i < num_groups - 1
    if isinstance(selection, int):
        return lambda i, m: i < selection
    if callable(selection):
        return lambda i, m: bool(selection(i, m))
    chosen = frozenset(selection)
    return lambda i, m: i in chosen


def plan_forward(
    selection: LayerSelection,
    calls: Sequence[Any],
    prefetch_layers: int | None,
    recomputed: tuple[int, ...] = (),
) -> Schedule:
    """The plan of a forward expected to call ``calls`` (modules, or ``None``) in order;
    ``recomputed`` calls are offloaded too, recomputed (Note [recomputed calls]).

    A selection that is not a callable ignores the modules: its plans are shared (a
    :class:`Schedule` is never modified), since every step asks for one."""
    if not callable(selection):
        key = (
            selection
            if selection is None or isinstance(selection, (int, str))
            else tuple(selection)
        )
        return _shared_plan(key, len(calls), prefetch_layers, recomputed)
    return _plan(selection, calls, prefetch_layers, recomputed)


@functools.lru_cache(maxsize=256, typed=True)
def _shared_plan(
    selection: Any, num_groups: int, prefetch_layers: int | None, recomputed: tuple[int, ...]
) -> Schedule:
    return _plan(selection, [None] * num_groups, prefetch_layers, recomputed)


def _plan(
    selection: LayerSelection,
    calls: Sequence[Any],
    prefetch_layers: int | None,
    recomputed: tuple[int, ...] = (),
) -> Schedule:
    select = resolve_selection(selection, len(calls))
    offloaded = [i for i, m in enumerate(calls) if select(i, m) or i in recomputed]
    plan = make_plan(len(calls), offloaded, prefetch_layers, select, recomputed)
    if not offloaded and _selects_nothing(selection):
        plan = dataclasses.replace(plan, offloads_nothing=True)
    return plan


def _selects_nothing(selection: LayerSelection) -> bool:
    """Whether ``selection`` selects no call at any index (a longer forward included)."""
    if isinstance(selection, bool) or callable(selection) or isinstance(selection, str):
        return False
    if isinstance(selection, int):
        return selection <= 0
    return selection is not None and len(selection) == 0


def check_selection(selection: LayerSelection, num_groups: int) -> None:
    """Raise ``ValueError`` when ``offload_layers`` does not fit ``num_groups`` layers."""
    if isinstance(selection, (bool, str)) or selection is None or callable(selection):
        return
    if isinstance(selection, int):
        if selection > num_groups:
            raise ValueError(
                f"offload_layers={selection} asks for more layers than the {num_groups} "
                f"given; pass an int <= {num_groups}"
            )
        return
    bad = [i for i in selection if i >= num_groups]
    if bad:
        raise ValueError(
            f"offload_layers={list(selection)} has indices {bad} out of range for "
            f"{num_groups} layers; accepted: 0 <= index < {num_groups}"
        )
