"""The planner: meet an activation-memory budget at the least predicted step time by
choosing one lever per layer.

Levers (:data:`LEVERS`):

* ``"keep"``: nothing; the layer's saved activations stay on the device.
* ``"offload"``: :class:`offload.ActivationOffloader` copies them to host memory
  (compressed with ``compress="fp8"`` when the plan is made with it).
* ``"selective"``: selective recompute (``torch.utils.checkpoint`` with a pair of
  dispatch modes, like PyTorch's ``create_selective_checkpoint_contexts``): the outputs
  of matrix products and attention are kept, everything else (norms, activations, the
  gated product, casts) is recomputed in backward. Outputs the recompute never reaches
  (it stops after the last tensor the backward needs: in a transformer block, the MLP's
  down projection) are not kept from the layer's second step on (:class:`_Kept`).
* ``"checkpoint"``: full recompute; only the layer's inputs are kept.
* ``"checkpoint_offload"``: full recompute whose inputs (all the checkpoint keeps) are
  offloaded: the layer keeps nothing on the device between its forward and its
  backward, and the link carries only its inputs (a few percent of its activations).
* ``"selective_offload"``: selective recompute whose kept tensors (the matrix products'
  and attention's outputs) are offloaded like an ``"offload"`` layer's: the recompute
  frees the cheap part, the link carries only what is expensive to recompute. Torch's
  selective checkpointing keeps those outputs where saved-tensor hooks cannot see them,
  so the selective levers have their own pair of dispatch modes (:class:`_KeepOutputs`,
  :class:`_RecomputeFromKept`), which here hand them to the offloader and take them back.
  The layer's inputs, which the checkpoint saves through the saved-tensor hooks, travel
  too.

Both ``*_offload`` levers put their layer in the offloader's ``offload_layers``: what
the checkpoint saves through saved-tensor hooks (its inputs) goes to the offloader like
any saved tensor of an offloaded layer, on the same release and reload schedule.

The cost model, measured on the user's own step (:func:`plan`), is deliberately small so
that every prediction can be explained:

* **Memory.** Layer ``i`` saves ``S_i`` bytes (what offloading it would move, measured by
  a forward with nothing offloaded). Between its forward and its backward it keeps
  ``resident_i``: ``S_i`` (keep), 0 (offload, selective_offload, checkpoint_offload,
  once released), ``rho_sel * S_i`` (selective), ``rho_ckpt * S_i`` (checkpoint); the
  offloaded ones hold what they send (``S_i``, ``rho_sel * S_i``, ``rho_ckpt * S_i``)
  until their release point and again once reloaded. During its forward a layer builds all
  ``S_i`` while the layers before it hold theirs (an offloaded group holds ``S_j`` until
  its release point, ``# Note [release order]``); during its backward it holds all
  ``S_i`` again (kept, reloaded or recomputed) while the layers below it hold their
  residents and the offloaded groups already reloaded for later (the reload points)
  hold ``S_j``. Each of those moments adds a workspace ``W``; the predicted peak is the
  largest of them. ``W`` comes from the step without levers (its peak minus the sum of
  ``S_i``); ``rho_sel`` and ``rho_ckpt`` are fitted to steps with each lever on every
  layer. Every prediction is anchored on the measured peak without levers.
* **Time.** Recompute adds to a layer's backward the measured extra time of its lever
  (the lever-on-every-layer step minus the plain step, shared out in proportion to the
  layers' forward times). Offloading follows ``offload/_auto.py``'s replay of the copy
  schedule (one copy stream per direction, overlapping the compute beside it, the
  release and reload points of ``# Note [release order]``); with ``compress="fp8"`` each
  offloaded layer also costs a time fitted to the every-layer offload step (the codec's
  kernels and their waits, which the copy model does not see). Predictions are
  anchored on the measured step without levers.

The search (:func:`optimize`) considers the plans of the form "the first ``k`` layers
offloaded, the next ``o`` selective_offload, the next ``c`` checkpointed (all of them
plain ``checkpoint`` or all ``checkpoint_offload``), the next ``s`` selective, the rest
kept": the offloaded layers come first (the release rule keeps the last groups
resident, so early layers hide their copies best), and the recompute levers are ordered
by what they keep (least first), which minimises every backward's peak for layers of
equal size. For each ``k``, ``o``, ``c`` and checkpoint kind it takes the fewest
selective layers that fit (a binary search), so it evaluates O(L^3 log L) plans, each
in O(L); beyond 16 layers it tries the counts on a stride first and then every count
near the fastest families found, which keeps the number of plans about that of 16
layers. The fastest few of them are then improved by hill climbing (one layer's lever
changed, or two neighbours swapped, while the predicted time drops within the budget),
which reaches the plans outside that form that mixed layer kinds favour. The tests
check the result against brute force over every assignment on small models.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload import _auto
from offload._handles import Kept, Raw, unpack_hook
from offload._plan import make_plan
from offload.config import _check_int

__all__ = [
    "DEFAULT_LEVERS",
    "LEVERS",
    "OFFLOADED",
    "RECOMPUTED",
    "Plan",
    "PlanCosts",
    "candidates",
    "optimize",
    "plan",
]

#: The levers (the search assigns them to layers in the order offload,
#: selective_offload, checkpoint or checkpoint_offload, selective, keep).
LEVERS = ("keep", "offload", "selective", "checkpoint", "selective_offload", "checkpoint_offload")

#: The levers :func:`plan` may use unless told otherwise: every lever. (It left
#: ``checkpoint_offload`` out while the benchmark could not tell it from checkpointing;
#: measured side by side on ref-8L, H200, checkpoint_offload on every layer but the last
#: took 111.0-111.6 ms against 112.8-113.3 ms for checkpointing every layer, at 1.03
#: against 1.16 GiB.) Pass a subset to forbid some.
DEFAULT_LEVERS = LEVERS

#: The levers whose layers the offloader handles (in its ``offload_layers``).
OFFLOADED = ("offload", "selective_offload", "checkpoint_offload")

#: The levers that run the layer's forward under ``torch.utils.checkpoint``.
RECOMPUTED = ("selective", "checkpoint", "selective_offload", "checkpoint_offload")

_SHORT = {
    "keep": "keep",
    "offload": "offload",
    "selective": "sel",
    "checkpoint": "ckpt",
    "selective_offload": "sel+off",
    "checkpoint_offload": "ckpt+off",
}


def _check_levers(levers: Sequence[str], name: str) -> tuple[str, ...]:
    if isinstance(levers, str) or not isinstance(levers, Sequence):
        raise TypeError(f"{name} must be a sequence of lever names; got {levers!r}")
    bad = [x for x in levers if x not in LEVERS]
    if bad:
        raise ValueError(f"{name}: unknown lever(s) {bad}; accepted: {', '.join(LEVERS)}")
    return tuple(levers)


# --------------------------------------------------------------------------------------
# the cost model


@dataclasses.dataclass(frozen=True)
class PlanCosts:
    """What one step costs per layer, as :func:`plan` measured it (or as a test sets it).

    Args:
        forward_s: device seconds of each layer's forward.
        backward_s: device seconds of each layer's backward.
        saved_bytes: ``S_i``, the bytes each layer saves for backward (what offloading it
            frees).
        link_bytes: bytes offloading each layer sends each way (``saved_bytes`` times the
            compression ratio with ``compress="fp8"``). Default: ``saved_bytes``.
        selective_kept: ``rho_sel``, the fraction of ``S_i`` a selective layer keeps.
        checkpoint_kept: ``rho_ckpt``, the fraction a checkpointed layer keeps.
        selective_s: extra backward seconds of each layer under selective recompute.
        checkpoint_s: extra backward seconds of each layer under full recompute.
        workspace_bytes: ``W``, backward memory beyond the saved activations.
        prefetch_bytes: extra memory while an offloaded layer's backward runs, beyond the
            groups the reload schedule has brought back. Default 0 (:func:`plan` does
            not fit it: the schedule accounts for the prefetched groups).
        d2h_bps, h2d_bps: host link bytes per second each way.
        gap_s: device seconds between the last layer's forward and its backward.
        step_s: measured seconds of the step without levers (predictions are anchored
            on it). Default: the model's own estimate.
        activation_bytes: measured activation peak without levers (the anchor of the
            memory predictions and what a fractional budget refers to). Default: the
            model's own estimate.
        offload_s: device seconds each layer's offloading costs beyond its copies,
            split between its forward and its backward (with ``compress="fp8"``,
            :func:`plan` fits it to the every-layer offload step: the codec's kernels
            and their waits). Default ``None``: none.

    Raises:
        ValueError: lists of different lengths, no layer, a negative number, or a
            fraction outside ``[0, 1]``.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]
    selective_kept: float
    checkpoint_kept: float
    selective_s: tuple[float, ...]
    checkpoint_s: tuple[float, ...]
    d2h_bps: float
    h2d_bps: float
    link_bytes: tuple[int, ...] | None = None
    workspace_bytes: int = 0
    prefetch_bytes: int = 0
    gap_s: float = 0.0
    step_s: float | None = None
    activation_bytes: int | None = None
    offload_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        names = ("forward_s", "backward_s", "saved_bytes", "selective_s", "checkpoint_s")
        for name in (*names, "link_bytes", "offload_s"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        n = len(self.forward_s)
        if n == 0:
            raise ValueError("PlanCosts needs at least one layer (forward_s is empty)")
        for name in (*names, "link_bytes", "offload_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) != n:
                raise ValueError(f"PlanCosts.{name} has {len(value)} entries, forward_s has {n}")
            if any(v < 0 for v in value):
                raise ValueError(f"PlanCosts.{name} has a negative entry: {list(value)}")
        for name in ("selective_kept", "checkpoint_kept"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"PlanCosts.{name}={getattr(self, name)}: must be in [0, 1]")
        for name in ("d2h_bps", "h2d_bps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PlanCosts.{name}={getattr(self, name)}: must be > 0")
        for name in ("workspace_bytes", "prefetch_bytes", "gap_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"PlanCosts.{name}={getattr(self, name)}: must be >= 0")
        # raw_memory() and raw_seconds() of the plans seen, per kind (the search and its
        # verification ask for the same plans again and again): levers tuple -> value.
        # Not a field: to_dict(), equality and repr ignore it.
        object.__setattr__(self, "_memos", {"memory": {}, "seconds": {}})

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    def _link(self) -> tuple[int, ...]:
        return self.link_bytes if self.link_bytes is not None else self.saved_bytes

    # ---- memory ----------------------------------------------------------------------

    def resident(self, i: int, lever: str) -> float:
        """Bytes layer ``i`` keeps between its forward and its backward under ``lever``."""
        s = self.saved_bytes[i]
        if lever == "keep":
            return s
        if lever in OFFLOADED:  # once released
            return 0.0
        if lever == "selective":
            return self.selective_kept * s
        return self.checkpoint_kept * s

    def share(self, lever: str) -> float:
        """The fraction of a layer's saved bytes that the offloader handles under
        ``lever``: all of them offloaded; what the recompute keeps (inputs included)
        under ``selective_offload`` (``rho_sel``) and ``checkpoint_offload``
        (``rho_ckpt``); else none."""
        if lever == "offload":
            return 1.0
        if lever == "selective_offload":
            return self.selective_kept
        if lever == "checkpoint_offload":
            return self.checkpoint_kept
        return 0.0

    def link_total(self, levers: Sequence[str]) -> float:
        """Bytes ``levers`` send each way over the link in one step."""
        link = self._link()
        return sum(self.share(lever) * link[i] for i, lever in enumerate(levers))

    def extra_seconds(self, i: int, lever: str) -> float:
        """Backward seconds that ``lever``'s recompute adds to layer ``i``."""
        if lever in ("selective", "selective_offload"):
            return self.selective_s[i]
        if lever in ("checkpoint", "checkpoint_offload"):
            return self.checkpoint_s[i]
        return 0.0

    def travels(self, i: int, lever: str) -> float:
        """Bytes of layer ``i`` that the offloader handles under ``lever`` (held on the
        device until the release point and again once reloaded): ``share(lever) * S_i``."""
        return self.share(lever) * self.saved_bytes[i]

    def raw_memory(self, levers: Sequence[str]) -> float:
        """The model's activation peak for ``levers`` (not anchored): the largest of
        every layer's forward and every layer's backward (module docstring). O(L): an
        offloaded group's travelling bytes are added after its forward and taken off at
        its release point (forward), added at its reload point and taken off after its
        backward (backward)."""
        L = len(levers)
        S, W = self.saved_bytes, self.workspace_bytes
        offloaded = [i for i, lever in enumerate(levers) if lever in OFFLOADED]
        schedule = make_plan(L, offloaded, None)
        travels = [self.travels(i, lever) for i, lever in enumerate(levers)]
        resident = [self.resident(i, lever) for i, lever in enumerate(levers)]
        # forward: held[i] = residents of j < i + travels of j < i not released by i
        gone = [0.0] * (L + 1)  # travelling bytes released when layer r starts
        for r, gs in schedule.release_at.items():
            gone[r] += sum(travels[g] for g in gs)
        peak = held = 0.0
        for i in range(L):
            held -= gone[i]
            peak = max(peak, held + S[i] + W)
            held += resident[i] + travels[i]
        # backward of layer i: residents below it, groups j < i reloaded at q >= i, itself
        back = [0.0] * L  # travelling bytes reloaded when the backward of q starts
        early = [0.0] * L  # ... of group i, reloaded before its own backward
        for q, gs in schedule.reload_at.items():
            for g in gs:
                if g < q:
                    back[q] += travels[g]
                    early[g] = travels[g]
        prefetched = 0.0
        below = total = sum(resident)
        for i in range(L - 1, -1, -1):
            below -= resident[i]
            prefetched += back[i] - early[i]  # its own bytes are in S[i] now
            extra = self.prefetch_bytes if levers[i] in OFFLOADED else 0.0
            peak = max(peak, below + prefetched + S[i] + extra + W)
        return max(peak, total)

    def memory(self, levers: Sequence[str]) -> float:
        """Predicted activation peak in bytes, anchored on the measured one."""
        return self._predicted("memory", self.raw_memory, self.activation_bytes, levers)

    def _predicted(
        self,
        kind: str,
        raw: Callable[[Sequence[str]], float],
        measured: float | None,
        levers: Sequence[str],
    ) -> float:
        """``raw(levers)``, anchored when ``measured`` (the value without levers) is
        known: ``measured + raw(levers) - raw(no levers)``. Raw values are remembered
        per plan (at most :data:`_MEMO_LIMIT` per kind, then forgotten all at once)."""
        memo: dict[tuple[str, ...], float] = self._memos[kind]  # type: ignore[attr-defined]
        value = _remembered(memo, tuple(levers), raw)
        if measured is None:
            return value
        return measured + value - _remembered(memo, ("keep",) * self.num_layers, raw)

    # ---- time ------------------------------------------------------------------------

    def _layer_costs(self, levers: Sequence[str]) -> list[_auto.LayerCost]:
        link = self._link()
        out = []
        for i, lever in enumerate(levers):
            fwd, bwd = self.forward_s[i], self.backward_s[i]
            share = self.share(lever)  # of the layer's link bytes that travel
            bwd += self.extra_seconds(i, lever)
            if share and self.offload_s is not None:
                fwd += share * self.offload_s[i] / 2
                bwd += share * self.offload_s[i] / 2
            out.append(_auto.LayerCost(fwd, bwd, int(share * link[i])))
        return out

    def raw_seconds(self, levers: Sequence[str]) -> float:
        offloaded = [i for i, lever in enumerate(levers) if lever in OFFLOADED]
        return _auto.predict_step(
            self._layer_costs(levers), offloaded, self.d2h_bps, self.h2d_bps, None, self.gap_s
        )

    def seconds(self, levers: Sequence[str]) -> float:
        """Predicted step seconds, anchored on the measured step without levers."""
        return self._predicted("seconds", self.raw_seconds, self.step_s, levers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanCosts:
        return cls(**data)


#: Most raw predictions a :class:`PlanCosts` remembers per kind (then it forgets them
#: all).
_MEMO_LIMIT = 200_000


def _remembered(
    memo: dict[tuple[str, ...], float],
    key: tuple[str, ...],
    raw: Callable[[Sequence[str]], float],
) -> float:
    """``raw(key)``, from ``memo`` when it is there."""
    value = memo.get(key)
    if value is None:
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        value = memo[key] = raw(key)
    return value


def _family(L: int, k: int, o: int, c: int, s: int, ckpt: str = "checkpoint") -> list[str]:
    return (
        ["offload"] * k
        + ["selective_offload"] * o
        + [ckpt] * c
        + ["selective"] * s
        + ["keep"] * (L - k - o - c - s)
    )


def optimize(costs: PlanCosts, budget_bytes: float, levers: Sequence[str] = LEVERS) -> list[str]:
    """The lever of each layer that meets ``budget_bytes`` at the least predicted time
    (the first of :func:`candidates`).

    Args:
        costs: the cost model (:class:`PlanCosts`).
        budget_bytes: the largest predicted activation peak allowed, in bytes.
        levers: the levers the search may use (``"keep"`` is always allowed).
            Default: all of :data:`LEVERS`.

    Returns:
        One lever name per layer.

    Raises:
        ValueError: no plan of the searched form fits; the message gives the smallest
            budget that does and the plan that reaches it.
    """
    return candidates(costs, budget_bytes, levers)[0][1]


def candidates(
    costs: PlanCosts, budget_bytes: float, levers: Sequence[str] = LEVERS
) -> list[tuple[float, list[str]]]:
    """Every plan of the searched form whose predicted peak fits ``budget_bytes`` (for
    each ``k`` offloaded, ``o`` selective_offload, ``c`` checkpointed and checkpoint
    kind, the fewest selective layers that fit), as ``(predicted seconds, levers)``,
    fastest first (equal times: fewer link bytes, then the smaller predicted peak,
    first). Same arguments and errors as :func:`optimize`."""
    allowed = set(_check_levers(levers, "levers")) | {"keep"}
    L = costs.num_layers
    kinds = [x for x in ("checkpoint", "checkpoint_offload") if x in allowed] or ["checkpoint"]
    found: list[tuple[float, list[str]]] = []
    smallest: tuple[float, list[str]] | None = None
    families: dict[tuple[int, int, int, str], float] = {}  # (k, o, c, kind) -> seconds

    def family(k: int, o: int, c: int, ckpt: str) -> None:
        """The fastest plan of the family (fewest selective layers that fit), if any."""
        nonlocal smallest
        if (k, o, c, ckpt) in families:
            return
        top = L - k - o - c if "selective" in allowed else 0
        # memory does not grow as layers go from kept to selective: take the first count
        # that fits (binary search), the cheapest of this family
        most = _family(L, k, o, c, top, ckpt)
        mem = costs.memory(most)
        if mem > budget_bytes:
            families[(k, o, c, ckpt)] = float("inf")
            if smallest is None or mem < smallest[0]:
                smallest = (mem, most)
            return
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi) // 2
            if costs.memory(_family(L, k, o, c, mid, ckpt)) <= budget_bytes:
                hi = mid
            else:
                lo = mid + 1
        candidate = _family(L, k, o, c, lo, ckpt)
        seconds = costs.seconds(candidate)
        families[(k, o, c, ckpt)] = seconds
        found.append((seconds, candidate))

    def counts(n: int, step: int, around: int | None = None) -> list[int]:
        """0..n-1 every ``step`` (the last one too), or every value within ``step`` of
        ``around``."""
        if n <= 0:
            return [0]
        if around is not None:
            return list(range(max(0, around - step), min(n, around + step + 1)))
        return sorted({*range(0, n, step), n - 1})

    def search(step: int, near: tuple[int, int, int, str] | None = None) -> None:
        nk, no, nc = (near[0], near[1], near[2]) if near is not None else (None, None, None)
        for k in counts(L, step, nk) if "offload" in allowed else [0]:
            for o in counts(L - k, step, no) if "selective_offload" in allowed else [0]:
                for ckpt in kinds if near is None else [near[3]]:
                    if ckpt not in allowed:
                        cs: Sequence[int] = [0]
                    else:  # an offloaded kind never takes the last layer
                        cs = counts(L - k - o + (ckpt not in OFFLOADED), step, nc)
                    for c in cs:
                        if c == 0 and ckpt != kinds[0]:
                            continue  # the same plans as with the first kind
                        family(k, o, c, ckpt)

    # Every family up to _FULL_SEARCH layers; beyond, the counts on a stride first (about
    # _FULL_SEARCH values each), then every count near the fastest families found.
    stride = -(-L // _FULL_SEARCH)
    search(stride)
    if stride > 1:
        best = sorted((t, f) for f, t in families.items() if t != float("inf"))
        for _, f in best[:_REFINED]:
            search(stride, f)
    if not found:
        assert smallest is not None
        raise ValueError(
            f"budget={budget_bytes / 2**30:.3f} GiB is below the smallest feasible "
            f"activation peak, {smallest[0] / 2**30:.3f} GiB (levers "
            f"{_summary(smallest[1])}); raise the budget or allow more levers"
        )
    key = _ranking(costs)
    found.sort(key=key)
    # then improve the best few one layer at a time (plans outside the family: an
    # input-offloaded checkpoint before a selective_offload layer, a plain checkpoint
    # between offloaded ones); improved plans that are new join the list
    seen = {tuple(levers) for _, levers in found}
    for _, levers in found[:_POLISHED]:
        better = _polish(costs, budget_bytes, levers, sorted(allowed), key)
        if tuple(better) not in seen:
            seen.add(tuple(better))
            found.append((costs.seconds(better), better))
    found.sort(key=key)
    return found


#: How many of the fastest family plans :func:`candidates` improves layer by layer.
_POLISHED = 4

#: Up to this many layers :func:`candidates` tries every family; with more, every
#: ``ceil(L / _FULL_SEARCH)``-th count of each lever first, then every count near the
#: :data:`_REFINED` fastest families (the search stays about as fast as at this size).
_FULL_SEARCH = 16
_REFINED = 8


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
    ``budget_bytes``; stops at a plan no such move improves. O(L * levers) plans a move."""
    L = len(levers)
    current = list(levers)
    best = key((costs.seconds(current), current))
    improved = True
    while improved:
        improved = False
        moves: list[list[str]] = []
        for i in range(L):
            for lever in allowed:
                if lever != current[i] and not (i == L - 1 and lever in OFFLOADED):
                    moves.append(current[:i] + [lever] + current[i + 1 :])
        for i in range(L - 2):  # the last layer keeps its place (never offloaded)
            if current[i] != current[i + 1]:
                moves.append(current[:i] + [current[i + 1], current[i]] + current[i + 2 :])
        for move in moves:
            if costs.memory(move) > budget_bytes:
                continue
            rank = key((costs.seconds(move), move))
            if rank < best:
                best, current, improved = rank, move, True
    return current


def _summary(levers: Sequence[str]) -> str:
    counts = {name: sum(1 for x in levers if x == name) for name in LEVERS}
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n)


# --------------------------------------------------------------------------------------
# recompute levers: a wrapped forward per layer


def _save_ops() -> frozenset[Any]:
    """The aten ops whose outputs selective recompute keeps: matrix products and
    attention (everything else is recomputed)."""
    aten = torch.ops.aten
    names = [
        ("mm", "default"),
        ("addmm", "default"),
        ("bmm", "default"),
        ("baddbmm", "default"),
        ("_scaled_mm", "default"),
        ("convolution", "default"),
        ("_scaled_dot_product_flash_attention", "default"),
        ("_scaled_dot_product_efficient_attention", "default"),
        ("_scaled_dot_product_cudnn_attention", "default"),
        ("_scaled_dot_product_flash_attention_for_cpu", "default"),
        ("_flash_attention_forward", "default"),
        ("_efficient_attention_forward", "default"),
    ]
    ops = []
    for name, overload in names:
        packet = getattr(aten, name, None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is not None:
            ops.append(op)
    return frozenset(ops)


_SAVE = _save_ops()


class _Kept:
    """What the selective levers of one layer keep, and what they have learnt not to.

    A selective layer keeps the outputs of the ops of :func:`_save_ops` (matrix
    products, attention) at forward, keyed ``(op, n)`` for the ``n``-th call of ``op``
    in the layer's forward, and its recompute returns them instead of running those
    ops again. The recompute stops after the last tensor the layer's backward needs
    (non-reentrant checkpoint's early stop), so an output made after that point (in a
    transformer block: the MLP's down projection, whose only consumer is the residual
    add) is never asked for. Each recompute that ends reports the keys it did not use;
    keys no recompute has used are not kept from the next forward on. The first step
    of a layer keeps them all (it is the one that learns).

    Invariant: skipping a key changes memory and time, never results. A skipped op that
    a later recompute does reach (other inputs, other control flow) simply runs again,
    as under full checkpointing; its key is kept again from then on.
    """

    __slots__ = ("unused", "used")

    def __init__(self) -> None:
        self.unused: frozenset[tuple[Any, int]] = frozenset()
        self.used: set[tuple[Any, int]] = set()

    def learn(self, left: set[tuple[Any, int]], consumed: set[tuple[Any, int]]) -> None:
        """One recompute ended: it reached the keys ``consumed`` and left the stored
        keys ``left`` untouched."""
        self.used |= consumed
        self.unused = frozenset((self.unused | left) - self.used)


def _call_key(calls: dict[Any, int], func: Any) -> tuple[Any, int]:
    """``(func, n)`` for the ``n``-th call of ``func`` counted in ``calls``: the key both
    halves of the selective levers give the same call (forward and recompute run the
    same ops in the same order)."""
    n = calls.get(func, 0)
    calls[func] = n + 1
    return (func, n)


class _KeepOutputs(TorchDispatchMode):
    """The forward half of the selective levers: runs every op and hands each tensor
    output of the kept ops (:func:`_save_ops`, less the keys ``kept`` learnt are never
    used) to ``pack`` (``Kept``: stays on the device; or the offloader's
    ``Step.pack``: a copy to the host, released on its schedule), into ``storage``."""

    def __init__(
        self, pack: Callable[[torch.Tensor], Any], storage: dict[Any, Any], kept: _Kept
    ) -> None:
        super().__init__()
        self.pack = pack
        self.storage = storage
        self.kept = kept
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SAVE:
            key = _call_key(self.calls, func)
            if key not in self.kept.unused:
                if isinstance(out, torch.Tensor):
                    entry: Any = self.pack(out)
                else:
                    entry = tuple(
                        self.pack(t) if isinstance(t, torch.Tensor) else Raw(t) for t in out
                    )
                self.storage[key] = entry
        return out


class _RecomputeFromKept(TorchDispatchMode):
    """The recompute half of the selective levers: a kept op returns what
    :class:`_KeepOutputs` stored for the same call (``unpack_hook``: checked for
    in-place changes, reloaded by the offloader) instead of running again; every other
    op runs. When the recompute ends it tells ``kept`` which stored keys it used."""

    def __init__(self, storage: dict[Any, Any], kept: _Kept) -> None:
        super().__init__()
        self.storage = storage
        self.kept = kept
        self.calls: dict[Any, int] = {}
        self.consumed: set[tuple[Any, int]] = set()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:  # what is still stored was never asked for
            self.kept.learn(set(self.storage), self.consumed)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _SAVE:
            key = _call_key(self.calls, func)
            self.consumed.add(key)  # reached: kept from now on, even if skipped so far
            entry = self.storage.pop(key, None)
            if entry is not None:
                if isinstance(entry, tuple):
                    return tuple(unpack_hook(e) for e in entry)
                return unpack_hook(entry)
        return func(*args, **(kwargs or {}))


class _Recompute:
    """A layer's forward run under ``torch.utils.checkpoint`` (non-reentrant): full
    (``checkpoint``; ``checkpoint_offload`` is the same wrapper on a layer the offloader
    handles, so the inputs the checkpoint saves travel), or selective (``selective``:
    the kept outputs stay on the device; ``selective_offload``: they go to
    ``offloader``, entered around the forward) through :class:`_KeepOutputs` and
    :class:`_RecomputeFromKept`; installed as the module's instance attribute
    ``forward`` and removed by :meth:`remove` (which restores what was there before)."""

    def __init__(
        self, module: torch.nn.Module, lever: str, offloader: Any = None, kept: _Kept | None = None
    ) -> None:
        self.module = module
        self.lever = lever
        self.offloader = offloader
        self.kept = kept if kept is not None else _Kept()
        self.had_attr = "forward" in module.__dict__
        self.previous = module.__dict__.get("forward")
        self.inner = module.forward
        module.forward = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        extra: dict[str, Any] = {}
        if self.lever in ("selective", "selective_offload"):
            extra["context_fn"] = self._selective_context
        return checkpoint(self.inner, *args, use_reentrant=False, **extra, **kwargs)

    def _selective_context(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        """``context_fn`` of the selective levers: a fresh storage per layer call. The
        kept outputs go to the offloader's current step under ``selective_offload``
        inside its context; otherwise they stay on the device (``Kept``)."""
        step = None
        if self.lever == "selective_offload" and self.offloader is not None:
            step = self.offloader._step
        pack = step.pack if step is not None else Kept
        storage: dict[Any, Any] = {}
        return _KeepOutputs(pack, storage, self.kept), _RecomputeFromKept(storage, self.kept)

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            if self.had_attr:
                self.module.forward = self.previous  # type: ignore[method-assign]
            else:
                del self.module.forward


# --------------------------------------------------------------------------------------
# the plan


class Plan:
    """One lever per layer, with what the planner predicted for it.

    Made by :func:`plan` (measured) or :meth:`from_levers` (chosen by hand). Nothing
    changes on the layers until :meth:`apply`; :meth:`remove` undoes it exactly.

    Args:
        layers: the layers, in call order (each called once per forward).
        levers: one of :data:`LEVERS` per layer; the last layer cannot be ``"offload"``
            or ``"selective_offload"``.
        costs: the :class:`PlanCosts` the plan was chosen with, or ``None``.
        budget_bytes: the budget it was chosen for, or ``None``.
        compress: ``compress`` of the offloader (``None`` or ``"fp8"``).
        min_tensor_bytes: ``min_tensor_bytes`` of the offloader. Default ``256 * 1024``.
        measured: what :func:`plan` measured (per configuration: step seconds and
            activation peak), for the report.

    Raises:
        TypeError: ``levers`` is not a sequence of names.
        ValueError: wrong number of levers, an unknown lever, the last layer offloaded.

    Example:
        >>> import torch, offload
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> p = offload.Plan(layers, ["checkpoint", "selective", "keep"])
        >>> p = p.apply()
        >>> y = layers[2](layers[1](layers[0](torch.randn(2, 8, requires_grad=True))))
        >>> y.sum().backward()
        >>> p.remove()
    """

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        levers: Sequence[str],
        *,
        costs: PlanCosts | None = None,
        budget_bytes: float | None = None,
        compress: str | None = None,
        min_tensor_bytes: int = 256 * 1024,
        measured: dict[str, Any] | None = None,
    ) -> None:
        self.layers = list(layers)
        self.levers = list(_check_levers(levers, "levers"))
        if len(self.levers) != len(self.layers):
            raise ValueError(
                f"levers has {len(self.levers)} entries for {len(self.layers)} layers; give one "
                f"per layer"
            )
        if self.levers and self.levers[-1] in OFFLOADED:
            raise ValueError(
                f"levers: the last layer cannot be {self.levers[-1]!r} (its backward starts "
                f"as soon as its forward ends: nothing to hide the copy behind); use 'keep' "
                f"or a recompute lever"
            )
        self.costs = costs
        self.budget_bytes = budget_bytes
        self.compress = compress
        self.min_tensor_bytes = min_tensor_bytes
        self.measured = measured or {}
        self._wrappers: list[_Recompute] = []
        self._offloader: Any = None
        self._handle: Any = None
        #: per layer, what its selective recompute was seen to use (``_Kept``), learnt
        #: by :func:`plan`'s measuring steps and handed to the selective wrappers of
        #: every plan made from them, so that their first step keeps no more than the
        #: next ones; ``None`` for a plan made by hand (its first step learns)
        self._learnt: list[_Kept] | None = None

    @classmethod
    def from_levers(
        cls, layers: Sequence[torch.nn.Module], levers: Sequence[str], **kw: Any
    ) -> Plan:
        """A plan chosen by hand (same arguments as the constructor)."""
        return cls(layers, levers, **kw)

    # ---- predictions -----------------------------------------------------------------

    @property
    def predicted_seconds(self) -> float | None:
        return None if self.costs is None else self.costs.seconds(self.levers)

    @property
    def predicted_bytes(self) -> float | None:
        return None if self.costs is None else self.costs.memory(self.levers)

    def replan(
        self,
        budget: int | float,
        *,
        step_fn: Callable[[], Any] | None = None,
        model: torch.nn.Module | None = None,
        steps: int = 3,
    ) -> Plan:
        """A new plan for another ``budget`` from the same measured costs (same layers,
        levers allowed, ``compress`` and ``min_tensor_bytes``).

        Args:
            budget: bytes (``int``) or a fraction of the activation peak without levers
                (``float`` in ``(0, 1]``).
            step_fn: with ``model``, check the choice as :func:`plan` does: apply the
                fastest predicted plans in turn until one's measured peak fits, then
                measure the next few predicted almost as fast and keep the fastest
                measured that fits. Default ``None``: the model's choice, unchecked (no
                step runs).
            model: the module whose forward runs the layers (with ``step_fn``).
            steps: measured steps per plan checked (after one warm-up). Default ``3``.

        Raises:
            RuntimeError: the plan has no costs (made by hand).
            ValueError: no plan meets the budget.
        """
        if self.costs is None:
            raise RuntimeError("this plan was made by hand: it has no costs to plan with")
        c = self.costs
        limit = _budget_bytes(budget, c.memory(["keep"] * c.num_layers))
        allowed = self.measured.get("levers", LEVERS)

        def make(levers: list[str]) -> Plan:
            made = Plan(
                self.layers,
                levers,
                costs=c,
                budget_bytes=limit,
                compress=self.compress,
                min_tensor_bytes=self.min_tensor_bytes,
                measured=dict(self.measured),
            )
            made._learnt = self._learnt
            return made

        _check_int("steps", steps, minimum=1)
        levers, checks = _verified(c, limit, allowed, make, step_fn, model, steps)
        chosen = make(levers)
        chosen.measured["checks"] = checks
        return chosen

    # ---- apply / remove --------------------------------------------------------------

    @property
    def offloader(self) -> Any:
        """The :class:`~offload.ActivationOffloader` of the offloaded layers (made by
        :meth:`apply`), or ``None`` when no layer is offloaded or before ``apply``."""
        return self._offloader

    @property
    def applied(self) -> bool:
        return bool(self._wrappers) or self._offloader is not None

    def apply(self, model: torch.nn.Module | None = None) -> Plan:
        """Install the levers: recompute wrappers on their layers and, when layers are
        offloaded, an :class:`~offload.ActivationOffloader` over them, entered around
        every forward of ``model`` (:meth:`~offload.ActivationOffloader.attach`) or, with
        ``model=None``, by ``with plan:`` around the forward.

        Args:
            model: the module whose forward runs the layers. Default ``None``.

        Returns:
            ``self``.

        Raises:
            RuntimeError: the plan is applied already.
        """
        from offload.activations import ActivationOffloader

        if self.applied:
            raise RuntimeError("this plan is applied already; call remove() first")
        try:
            offloaded = [i for i, lever in enumerate(self.levers) if lever in OFFLOADED]
            if offloaded:
                self._offloader = ActivationOffloader(
                    self.layers,
                    offload_layers=offloaded,
                    compress=self.compress,
                    min_tensor_bytes=self.min_tensor_bytes,
                )
            for i, (layer, lever) in enumerate(zip(self.layers, self.levers)):
                if lever in RECOMPUTED:
                    kept = self._learnt[i] if self._learnt is not None else None
                    self._wrappers.append(_Recompute(layer, lever, self._offloader, kept))
            if self._offloader is not None and model is not None:
                self._handle = self._offloader.attach(model)
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Undo :meth:`apply`: the layers' forwards are what they were, the offloader
        is closed (its host memory freed). Idempotent."""
        for wrapper in reversed(self._wrappers):
            wrapper.remove()
        self._wrappers.clear()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._offloader is not None:
            self._offloader.close()
            self._offloader = None

    def __enter__(self) -> Plan:
        if self._offloader is not None and self._handle is None:
            self._offloader.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._offloader is not None and self._handle is None:
            self._offloader.__exit__(*exc)

    # ---- report ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: levers, predictions, budget, costs, measurements."""
        return {
            "levers": list(self.levers),
            "predicted_seconds": self.predicted_seconds,
            "predicted_bytes": self.predicted_bytes,
            "budget_bytes": self.budget_bytes,
            "compress": self.compress,
            "costs": None if self.costs is None else self.costs.to_dict(),
            "measured": self.measured,
        }

    def table(self) -> Any:
        """A :class:`rich.table.Table`: one row per layer (lever, bytes kept between
        forward and backward, bytes sent each way, added backward ms) and a total row."""
        from rich.table import Table

        from offload.profiling import format_bytes

        table = Table(title="offload plan", title_justify="left")
        for name in ("layer", "lever", "kept", "link", "+ms"):
            table.add_column(name, justify="left" if name == "lever" else "right")
        c = self.costs
        kept_total = link_total = extra_total = 0.0
        for i, lever in enumerate(self.levers):
            if c is None:
                table.add_row(str(i), lever, "-", "-", "-")
                continue
            kept = c.resident(i, lever)
            link = c.share(lever) * c._link()[i]
            extra = c.extra_seconds(i, lever)
            kept_total += kept
            link_total += link
            extra_total += extra
            table.add_row(
                str(i),
                lever,
                format_bytes(kept),
                format_bytes(link) if link else "-",
                f"{extra * 1e3:.2f}" if extra else "-",
            )
        if c is not None:
            table.add_row(
                "all",
                _summary(self.levers),
                format_bytes(kept_total),
                format_bytes(link_total),
                f"{extra_total * 1e3:.2f}",
                style="bold",
            )
        return table

    def summary(self) -> str:
        """Predicted time and peak against the step without levers and the budget."""
        from offload.profiling import format_bytes

        c = self.costs
        if c is None:
            return f"plan: {_summary(self.levers)} (chosen by hand: no predictions)"
        t, m = self.predicted_seconds, self.predicted_bytes
        base_t = c.step_s if c.step_s is not None else c.raw_seconds(["keep"] * c.num_layers)
        base_m = c.memory(["keep"] * c.num_layers)
        budget = "" if self.budget_bytes is None else f" (budget {format_bytes(self.budget_bytes)})"
        return (
            f"plan: {_summary(self.levers)}; predicted step {t * 1e3:.1f} ms "  # type: ignore[operator]
            f"({t / base_t:.3f}x the step without levers, {base_t * 1e3:.1f} ms); predicted "  # type: ignore[operator]
            f"activation peak {format_bytes(m)} of {format_bytes(base_m)} without levers{budget}"  # type: ignore[arg-type]
        )

    def report(self, console: Any = None) -> None:
        """Print the table, the measured configurations (when measured) and the summary."""
        from rich.console import Console

        from offload.profiling import format_bytes

        console = console or Console()
        console.print(self.table())
        rows = self.measured.get("configs")
        if rows:
            base = rows.get("none", {}).get("seconds")
            parts = []
            for name, row in rows.items():
                ratio = f" {row['seconds'] / base:.2f}x" if base else ""
                parts.append(f"{name}{ratio} {format_bytes(row['peak_bytes'])}")
            console.print("measured, every layer: " + "; ".join(parts), style="dim")
        console.print(self.summary())

    def __repr__(self) -> str:
        return f"Plan({_summary(self.levers)})"


# --------------------------------------------------------------------------------------
# measuring


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _run(step_fn: Callable[[], Any], steps: int, warmup: int) -> dict[str, Any]:
    """Median step seconds (CUDA events), the largest activation peak (allocated
    during the step above what was allocated before it: weights, gradients) and every
    measured step's seconds (``"times"``).

    Every configuration is measured from the same state, so that their times compare:
    garbage collected and the caching allocator's unused blocks released first (blocks
    cached by the configuration measured before, of other sizes, made steps of ref-8L
    scatter by up to 14 %)."""
    times, peaks = [], []
    gc.collect()
    torch.cuda.empty_cache()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step_fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
            peaks.append(torch.cuda.max_memory_allocated() - before)
    return {"seconds": _median(times), "peak_bytes": float(max(peaks)), "times": times}


def _cuda_available() -> bool:
    """Whether :func:`plan` can measure (a seam for the CPU tests of its logic)."""
    return torch.cuda.is_available()


def _fit(f: Callable[[float], float], target: float, hi: float) -> float:
    """The ``x`` in ``[0, hi]`` with ``f(x)`` closest to ``target`` (``f`` grows)."""
    lo = 0.0
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


#: Plans :func:`plan` applies and measures (at most), until one fits.
VERIFY_CANDIDATES = 6

#: Once a plan fits, :func:`plan` also measures up to this many of the next fastest
#: predicted plans (its "rivals") ...
VERIFY_RIVALS = 3

#: ... those predicted at most this fraction slower than the plan that fits ...
VERIFY_CLOSE = 0.03

#: ... and when one of them fits too, the plans that fit are measured again in
#: :data:`VERIFY_ROUNDS` more rounds, each round in the reverse order of the one before,
#: and each plan's steps pooled: a plan measured once, right after another, can differ
#: by 2-3 % from its measurement in alternation with the others (ref-8L, H200: the
#: device has slower steps about every ten steps, and a fresh offloader's first steps
#: allocate) ...
VERIFY_ROUNDS = 2

#: ... and a rival replaces the model's choice only when its pooled median is at least
#: this fraction faster (pooled medians of one plan in two runs differed by about 1 %).
VERIFY_GAIN = 0.01

#: Unmeasured steps before each measured block of :func:`plan`'s verification: the
#: allocator's cache is emptied before each block and a plan applied anew makes a new
#: offloader, so the first steps allocate (ref-8L, H200: up to 110 ms against 90).
VERIFY_WARMUP = 2


def _verified(
    costs: PlanCosts,
    limit: float,
    allowed: Sequence[str],
    make: Callable[[list[str]], Plan],
    step_fn: Callable[[], Any] | None,
    model: torch.nn.Module | None,
    steps: int = 3,
) -> tuple[list[str], list[dict[str, Any]]]:
    """The plan to use: the fastest *measured* of the plans that fit ``limit`` among
    the model's fastest predictions.

    Fit first. The model's choice is applied and ``steps`` steps measured (after one
    warm-up). When its peak exceeds the budget, the model has under-predicted that plan
    by ``measured - predicted``; the search runs again for a budget lowered by half
    that error after the first miss and by the largest error seen after later ones
    (plans that fit only within that room are passed over, not tried one by one) and
    the fastest plan not yet tried is measured next, at most
    :data:`VERIFY_CANDIDATES` in all; when no plan is predicted to fit with that room,
    the next plan of the first ranking is tried.

    Then speed. The model leaves out what it cannot see (the host's work for offloaded
    tensors and selective layers, which costs device time at a step's start, when no
    device work is queued; measured on ref-8L, H200: 0.5-2 ms), so plans it ranks within
    a few percent can measure in another order. The next :data:`VERIFY_RIVALS` plans of
    the same ranking predicted within :data:`VERIFY_CLOSE` of the one that fits are
    measured too. When one of them fits, every plan that fits is measured again in
    :data:`VERIFY_ROUNDS` rounds of alternating order, its steps pooled, and the fastest
    pooled median is kept (a rival must be :data:`VERIFY_GAIN` faster than the model's
    choice to replace it).

    Without ``step_fn`` the model's choice is returned unchecked. Every measurement is
    in the returned checks (``"rival": True`` for the second part; ``"times"``: every
    measured step; ``"pooled_seconds"``: the median of those, for the plans measured in
    rounds)."""
    first = ranked = candidates(costs, limit, allowed)
    if step_fn is None:
        return ranked[0][1], []
    checks: list[dict[str, Any]] = []
    tried: set[tuple[str, ...]] = set()

    def measure(levers: list[str]) -> dict[str, Any]:
        applied = make(levers).apply(model)
        try:
            return _run(step_fn, steps, VERIFY_WARMUP)
        finally:
            applied.remove()

    def trial(predicted: float, levers: list[str], rival: bool) -> dict[str, Any]:
        tried.add(tuple(levers))
        got = measure(levers)
        check = {
            "levers": levers,
            "predicted_seconds": predicted,
            "predicted_bytes": costs.memory(levers),
            "measured_seconds": got["seconds"],
            "measured_bytes": got["peak_bytes"],
            "fits": got["peak_bytes"] <= limit,
            "rival": rival,
            "times": list(got["times"]),
        }
        checks.append(check)
        return check

    margin = 0.0
    misses = 0
    chosen: dict[str, Any] | None = None
    while len(checks) < VERIFY_CANDIDATES:
        if margin > 0:
            # half the error seen after the first miss (one plan's error overstates
            # others': on ref-8L a plan missed by 0.057 GiB and the next fastest, 1 MiB
            # short of that room, measured 0.04 GiB above its prediction and fit), the
            # whole of it after the next
            room = margin / 2 if misses == 1 else margin
            try:
                ranked = candidates(costs, limit - room, allowed)
            except ValueError:
                # nothing is predicted to fit with that much room (the error was that
                # plan's, not every plan's): the next of the first ranking
                ranked = first
        todo = [(t, levers) for t, levers in ranked if tuple(levers) not in tried]
        if not todo:
            break
        check = trial(*todo[0], rival=False)
        if check["fits"]:
            chosen = check
            break
        misses += 1
        margin = max(margin, check["measured_bytes"] - check["predicted_bytes"])
    if chosen is None:
        _raise_none_fits(checks, limit, margin)
    close = chosen["predicted_seconds"] * (1.0 + VERIFY_CLOSE)
    rivals = [(t, lv) for t, lv in ranked if tuple(lv) not in tried and t <= close]
    fitting = [chosen]
    for predicted, levers in rivals[:VERIFY_RIVALS]:
        check = trial(predicted, levers, rival=True)
        if check["fits"]:
            fitting.append(check)
    if len(fitting) > 1:
        for r in range(VERIFY_ROUNDS):
            for check in fitting[::-1] if r % 2 == 0 else fitting:
                check["times"] += measure(check["levers"])["times"]
        for check in fitting:
            check["pooled_seconds"] = _median(check["times"])
        best = min(fitting, key=lambda c: c["pooled_seconds"])
        if best["pooled_seconds"] < chosen["pooled_seconds"] * (1.0 - VERIFY_GAIN):
            chosen = best
    return chosen["levers"], checks


def _raise_none_fits(checks: list[dict[str, Any]], limit: float, margin: float) -> None:
    if not checks:
        raise ValueError(f"budget={limit / 2**30:.3f} GiB: no plan to measure")
    worst = min(checks, key=lambda c: c["measured_bytes"])
    tried_text = "; ".join(
        f"({' '.join(_SHORT[x] for x in c['levers'])}) predicted "
        f"{c['predicted_bytes'] / 2**30:.3f}, measured {c['measured_bytes'] / 2**30:.3f} GiB"
        for c in checks
    )
    raise ValueError(
        f"budget={limit / 2**30:.3f} GiB: the {len(checks)} plans tried (the fastest "
        f"predicted to fit, then the fastest predicted to fit with room for the model's "
        f"error, {margin / 2**30:.3f} GiB) measured above it (lowest "
        f"{worst['measured_bytes'] / 2**30:.3f} GiB, levers {_summary(worst['levers'])}); "
        f"raise the budget. Tried: {tried_text}"
    )


def _budget_bytes(budget: Any, activation_bytes: float) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"budget must be bytes (an int) or a fraction of the activation peak without "
            f"levers (a float in (0, 1]); got {type(budget).__name__} {budget!r}"
        )
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(
                f"budget={budget}: a float is a fraction of the activation peak without "
                f"levers and must be in (0, 1]; pass bytes as an int"
            )
        return budget * activation_bytes
    if budget <= 0:
        raise ValueError(f"budget={budget}: bytes must be > 0")
    return float(budget)


def plan(
    step_fn: Callable[[], Any],
    layers: Sequence[torch.nn.Module],
    *,
    budget: int | float,
    model: torch.nn.Module | None = None,
    levers: Sequence[str] = DEFAULT_LEVERS,
    compress: str | None = None,
    min_tensor_bytes: int = 256 * 1024,
    steps: int = 3,
    warmup: int = 1,
    verify: bool = True,
) -> Plan:
    """Measure ``step_fn`` and choose a lever per layer that meets ``budget`` at the
    least predicted step time (the model and the search: ``offload/_planner.py``).

    ``step_fn()`` runs one forward and backward of the model (no optimizer step, no
    offload context: the planner installs what it measures). It runs ``warmup + steps``
    times in each of these configurations, on the same model and state: nothing; an
    offloader with ``offload_layers="auto"`` (two forwards: its measuring forward gives
    each layer's forward and backward time and saved bytes, and the link bandwidth);
    every layer but the last offloaded; every layer selective; every layer checkpointed
    (levers not allowed are skipped). Gradients accumulate across these steps.

    Args:
        step_fn: ``callable()``: forward and backward.
        layers: the repeated blocks, in call order, each called once per forward.
        budget: the activation peak allowed: bytes (``int``) or a fraction of the
            measured peak without levers (``float`` in ``(0, 1]``). "Activation peak":
            the most memory allocated during a step above what was allocated before it.
        model: the module whose forward runs ``layers`` (required: the measuring
            offloaders are entered around its forward).
        levers: the levers the plan may use. Default: :data:`DEFAULT_LEVERS` (every
            lever of :data:`LEVERS`).
        compress: ``None`` (default) or ``"fp8"``: offloaded layers travel compressed
            (lossy, see :class:`~offload.ActivationOffloader`).
        min_tensor_bytes: of the offloader. Default ``256 * 1024``.
        steps: measured steps per configuration (>= 1). Default ``3``.
        warmup: unmeasured steps before them (>= 1: the first step of a fresh model
            allocates its gradients, which must not count as activations). Default ``1``.
        verify: apply the fastest predicted plan, measure ``steps`` steps (after a
            warm-up) and, when its peak exceeds the budget (the model errs by a few
            percent), plan again with room for the error seen and try that plan, up to
            :data:`VERIFY_CANDIDATES` plans; then measure up to
            :data:`VERIFY_RIVALS` plans predicted within :data:`VERIFY_CLOSE` of the
            one that fits, measure those that fit again in :data:`VERIFY_ROUNDS`
            alternating rounds and keep the fastest. Default ``True``.

    The activation peak is measured above what is allocated before each step, gradients
    included (they accumulate across the planner's steps). A loop that sets gradients
    to ``None`` before every step (``zero_grad(set_to_none=True)``) allocates them during
    the step, on top of the planned peak: leave room for them in the budget.

    Returns:
        A :class:`Plan`, not applied (call :meth:`Plan.apply`; :meth:`Plan.replan` gives
        the plan of another budget from the same measurement).

    Raises:
        TypeError: a wrong type (``step_fn`` not callable, ``budget`` not a number).
        ValueError: a bad value; no ``model``; a budget no plan meets (the message
            gives the smallest that one does), or none of the plans tried measured
            within it.
        RuntimeError: no CUDA device (the planner measures device time and memory).

    Example::

        p = offload.plan(step, model.layers, budget=0.5, model=model)
        p.report()
        p.apply(model)      # then train as usual; p.remove() undoes it
    """
    from offload.activations import ActivationOffloader

    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable; got {type(step_fn).__name__}")
    allowed = _check_levers(levers, "levers")
    layers = list(layers)
    if len(layers) < 1:
        raise ValueError("layers is empty")
    _budget_bytes(budget, 1.0)  # its type and range, before anything is measured
    if model is None or not isinstance(model, torch.nn.Module):
        raise ValueError(
            "model must be the nn.Module whose forward calls the layers (the planner "
            "enters its measuring offloaders around that forward); got "
            f"{type(model).__name__}"
        )
    _check_int("steps", steps, minimum=1)
    _check_int("warmup", warmup, minimum=1)
    try:
        inspect.signature(step_fn).bind()
    except TypeError:
        raise TypeError("step_fn must be callable with no arguments") from None
    except ValueError:  # no signature (some builtins): trust it
        pass
    if not _cuda_available():
        raise RuntimeError(
            "offload.plan measures device time and memory and needs a CUDA device; on a "
            "machine without one, build a Plan by hand (offload.Plan(layers, levers))"
        )
    L = len(layers)
    configs: dict[str, dict[str, float]] = {}
    configs["none"] = _run(step_fn, steps, warmup)

    # per-layer costs and the link: the measuring forward of "auto" (uncompressed bytes)
    probe = ActivationOffloader(layers, offload_layers="auto", min_tensor_bytes=min_tensor_bytes)
    handle = probe.attach(model)
    try:
        _run(step_fn, 1, 1)
        auto = probe.stats.auto or {}
    finally:
        handle.remove()
        probe.close()
    if "costs" not in auto:
        raise RuntimeError(
            f"the measuring forward did not produce layer costs ({auto.get('reason')!r}); "
            f"does step_fn call model's forward once per step?"
        )
    lc = auto["costs"]
    if len(lc) != L:
        raise RuntimeError(
            f"the measuring forward saw {len(lc)} layer calls for {L} layers: each layer "
            f"must be called once per forward"
        )
    fwd = [float(c["forward_s"]) for c in lc]
    bwd = [float(c["backward_s"]) for c in lc]
    saved = [int(c["nbytes"]) for c in lc]
    d2h, h2d = auto["d2h_gbps"] * 1e9, auto["h2d_gbps"] * 1e9
    gap = float(auto.get("gap_s", 0.0))
    base_s, base_m = configs["none"]["seconds"], configs["none"]["peak_bytes"]
    total_f = sum(fwd) or 1.0

    def shares(extra_s: float) -> tuple[float, ...]:
        return tuple(max(0.0, extra_s) * f / total_f for f in fwd)

    link = list(saved)
    if ("offload" in allowed or "selective_offload" in allowed) and L > 1:
        off = ActivationOffloader(
            layers, offload_layers="all", compress=compress, min_tensor_bytes=min_tensor_bytes
        )
        handle = off.attach(model)  # type: ignore[arg-type]
        try:
            configs["offload"] = _run(step_fn, steps, warmup)
            sent = off.stats.bytes_offloaded
        finally:
            handle.remove()
            off.close()
        moved = sum(saved[: L - 1])
        if moved and compress is not None:
            ratio = sent / moved
            link = [int(s * ratio) for s in saved]
    learnt: list[_Kept] | None = None
    for lever in ("selective", "checkpoint"):
        if lever in allowed or f"{lever}_offload" in allowed:
            wrappers = [_Recompute(layer, lever) for layer in layers]
            try:
                configs[lever] = _run(step_fn, steps, warmup)
            finally:
                for w in reversed(wrappers):
                    w.remove()
            if lever == "selective":
                learnt = [w.kept for w in wrappers]

    workspace = max(0.0, base_m - sum(saved))

    def model_costs(**kw: Any) -> PlanCosts:
        fields: dict[str, Any] = dict(
            forward_s=fwd,
            backward_s=bwd,
            saved_bytes=saved,
            link_bytes=link,
            selective_kept=1.0,
            checkpoint_kept=1.0,
            selective_s=shares(configs.get("selective", {}).get("seconds", base_s) - base_s),
            checkpoint_s=shares(configs.get("checkpoint", {}).get("seconds", base_s) - base_s),
            d2h_bps=d2h,
            h2d_bps=h2d,
            workspace_bytes=int(workspace),
            gap_s=gap,
            step_s=base_s,
            activation_bytes=int(base_m),
        )
        fields.update(kw)
        return PlanCosts(**fields)

    fitted: dict[str, Any] = {}
    for lever, name in (("selective", "selective_kept"), ("checkpoint", "checkpoint_kept")):
        if lever in configs:
            target = configs[lever]["peak_bytes"]
            fitted[name] = _fit(
                lambda x, n=name, lv=lever: model_costs(**{**fitted, n: x}).memory([lv] * L),
                target,
                1.0,
            )
    if compress is not None and "offload" in configs:
        # the codec's kernels and the waits they add are not in the copy model: fit one
        # cost per offloaded layer to the every-layer offload step
        levers_all = ["offload"] * (L - 1) + ["keep"]
        residual = configs["offload"]["seconds"] - model_costs(**fitted).seconds(levers_all)
        per_layer = max(0.0, residual) / (L - 1)
        fitted["offload_s"] = tuple(per_layer for _ in range(L))
    measured = Plan(
        layers,
        ["keep"] * L,
        costs=model_costs(**fitted),
        compress=compress,
        min_tensor_bytes=min_tensor_bytes,
        measured={"configs": configs, "fitted": fitted, "levers": list(allowed)},
    )
    measured._learnt = learnt
    return measured.replan(budget, step_fn=step_fn if verify else None, model=model, steps=steps)
