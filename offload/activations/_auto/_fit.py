"""Layer costs as functions of the input's size, carried from the sizes measured to the
sizes not measured (``offload_layers="auto"``).

A transformer layer's matrix products, norms and saved activations grow with the number
of tokens ``n``; its attention's score work grows with ``n`` times the sequence length
(``q = n * s``: ``s**2`` per sequence). Every measured quantity ``y`` of every layer
(forward and backward seconds, host seconds, bytes sent and freed) and of the step (the
gap after the last layer, the activation peak) is fitted as ``y = a*n + b*q + c`` with
``a, b, c >= 0`` from the sizes measured, by least squares over every subset of the
three terms (the best fit whose coefficients are all non-negative wins; with fewer
points than terms, the subsets that points can determine, the fewest terms preferred
last): one point scales with ``n``; two fit ``a*n + b*q``. Within a measured step,
identical layer calls whose times disagree by more than ``one_time`` carry a
one-time cost (:func:`steady`), which no other step pays.

State is bounded: at most ``max_points`` sizes are kept; a new size replaces one
measured at the same size, or the one closest to its neighbours (the spread is what
makes a fit). A point marked ``cold`` (the process's first step: the allocator and
the kernels warm up in it) is dropped as soon as a warm one exists.

The tuning named in lower case (``max_points``, ...) is a field of
:class:`~offload.activations._auto._settings.AutoSettings`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from offload.activations._auto._predict import LayerCost
from offload.activations._auto._settings import DEFAULT_AUTO, AutoSettings

__all__ = [
    "Estimate",
    "Point",
    "ShapeModel",
    "point_values",
    "sizes",
    "steady",
    "warm_up",
]


#: Quantities per layer call in a point's ``values``, in this order.
FIELDS = ("forward_s", "backward_s", "host_forward_s", "host_backward_s", "link", "freed")


def sizes(shape: Sequence[int]) -> tuple[int, int]:
    """``(n, q)`` of a layer input of ``shape`` (``[..., s, hidden]``): ``n`` tokens
    (every dimension but the last) and ``q = n * s`` (``s``: the dimension before the
    last, the sequence)."""
    lead = list(shape[:-1]) or [1]
    n = math.prod(lead)
    return n, n * lead[-1]


@dataclasses.dataclass
class Point:
    """One measured size: ``values`` holds, per layer call, :data:`FIELDS` in order,
    then the step's ``gap_s`` and ``act_bytes`` (the peak with ``"all"`` less what was
    allocated at the first call's start; ``None``: unknown)."""

    tokens: int
    quad: int
    values: list[float]
    copies: list[int]
    act_bytes: float | None
    cold: bool = False


@dataclasses.dataclass
class Estimate:
    """Costs at one size, measured (``exact``) or predicted."""

    costs: list[LayerCost]
    gap_s: float
    freed: list[float]
    act_bytes: float | None
    exact: bool


#: Term subsets tried, most terms first (a tie keeps the earlier one), by how many
#: points there are: a subset needs at least as many points as terms.
_SUBSETS: dict[int, list[tuple[int, ...]]] = {
    1: [(0,)],
    2: [(0, 1), (0,), (1,)],
    3: [(0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)],
}


class ShapeModel:
    """The measured sizes of one kind of input (``num_groups`` layer calls) and the fit
    that predicts the others (module docstring)."""

    def __init__(self, num_groups: int, settings: AutoSettings = DEFAULT_AUTO) -> None:
        self.num_groups = num_groups
        self.settings = settings
        self.points: list[Point] = []
        self._coef: torch.Tensor | None = None  # [3, columns] over scaled terms
        self._scale = (1.0, 1.0)
        #: bumped whenever the points change (predictions made before are stale)
        self.version = 0

    def add(self, point: Point) -> None:
        """Keep ``point`` (bounded: see the module docstring)."""
        if len(point.copies) != self.num_groups:
            raise ValueError(
                f"point has {len(point.copies)} layer calls; this model has {self.num_groups}"
            )
        keep = [p for p in self.points if (p.tokens, p.quad) != (point.tokens, point.quad)]
        if not point.cold:
            keep = [p for p in keep if not p.cold]
        while len(keep) >= self.settings.max_points:
            keep.remove(_most_crowded(keep))
        keep.append(point)
        self.points = keep
        self._coef = None
        self.version += 1

    def predict(self, tokens: int, quad: int) -> Estimate:
        """The costs at ``(tokens, quad)``: a measured point's own, or the fit's."""
        L = self.num_groups
        for p in self.points:
            if (p.tokens, p.quad) == (tokens, quad):
                return self._estimate(p.values, p.copies, p.act_bytes, True)
        if not self.points:
            raise ValueError("no size measured yet")
        coef = self._fit()
        sn, sq = self._scale
        x = torch.tensor([tokens / sn, quad / sq, 1.0], dtype=torch.float64)
        y = (x @ coef).clamp_min(0.0).tolist()
        nearest = min(self.points, key=lambda p: abs(math.log(p.tokens / max(1, tokens))))
        act = None
        if all(p.act_bytes is not None for p in self.points):
            act = y[len(FIELDS) * L + 1]
        return self._estimate(y, nearest.copies, act, False)

    def within(self, tokens: int) -> bool:
        """Whether ``tokens`` lies inside the sizes measured (warm ones where any),
        widened by ``extrapolation`` each way: a prediction there is trusted, and
        what a step takes beyond it is the scale's (``offload/activations/_auto/_family.py``)."""
        pts = [p for p in self.points if not p.cold] or self.points
        if not pts:
            return False
        lo = min(p.tokens for p in pts) / self.settings.extrapolation
        hi = max(p.tokens for p in pts) * self.settings.extrapolation
        return lo <= tokens <= hi

    def _estimate(
        self, values: Sequence[float], copies: list[int], act: float | None, exact: bool
    ) -> Estimate:
        F = len(FIELDS)
        costs, freed = [], []
        for i in range(self.num_groups):
            fwd, bwd, hf, hb, link, fr = values[F * i : F * i + F]
            costs.append(LayerCost(fwd, bwd, int(link), hf, hb, copies[i]))
            freed.append(fr)
        return Estimate(costs, values[F * self.num_groups], freed, act, exact)

    def _fit(self) -> torch.Tensor:
        """Coefficients ``[3, columns]`` of the scaled terms ``(n / n_max, q / q_max,
        1)``, per column the best non-negative fit (module docstring)."""
        if self._coef is not None:
            return self._coef
        pts = self.points
        sn = float(max(p.tokens for p in pts))
        sq = float(max(p.quad for p in pts))
        self._scale = (sn, sq)
        X = torch.tensor([[p.tokens / sn, p.quad / sq, 1.0] for p in pts], dtype=torch.float64)
        Y = torch.tensor([p.values for p in pts], dtype=torch.float64)
        columns = Y.shape[1]
        best = torch.full((columns,), math.inf, dtype=torch.float64)
        coef = torch.zeros(3, columns, dtype=torch.float64)
        # relative tolerance on the squared error: a subset with more terms wins a tie
        floor = 1e-18 + 1e-12 * Y.square().sum(0)
        for subset in _SUBSETS[min(3, len(pts))]:
            XS = X[:, list(subset)]
            sol = torch.linalg.lstsq(XS, Y).solution
            sse = (XS @ sol - Y).square().sum(0)
            feasible = (sol >= -1e-12 * sol.abs().amax(0).clamp_min(1e-300)).all(0)
            better = feasible & (sse + floor < best)
            if better.any():
                best = torch.where(better, sse, best)
                full = torch.zeros(3, columns, dtype=torch.float64)
                full[list(subset)] = sol.clamp_min(0.0)
                coef = torch.where(better.unsqueeze(0), full, coef)
        self._coef = coef
        return coef


def warm_up() -> None:
    """One tiny fit: the first least-squares solve of a process initialises the linear
    algebra library (tens of milliseconds on some hosts), which the measuring step pays
    so that the first decision's step does not."""
    one = torch.ones(1, 1, dtype=torch.float64)
    torch.linalg.lstsq(one, one)


def point_values(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    host_forward_s: Sequence[float],
    host_backward_s: Sequence[float],
    link: Sequence[float],
    freed: Sequence[float],
    gap_s: float,
    act_bytes: float | None,
) -> list[float]:
    """A point's ``values`` from per-call lists (:data:`FIELDS`) and the step's two."""
    out: list[float] = []
    for row in zip(forward_s, backward_s, host_forward_s, host_backward_s, link, freed):
        out.extend(float(v) for v in row)
    out.append(float(gap_s))
    out.append(float(act_bytes or 0.0))
    return out


def steady(
    times: Sequence[Sequence[float]],
    sizes: Sequence[float],
    settings: AutoSettings = DEFAULT_AUTO,
) -> list[list[float]]:
    """Per-call times (each of ``times`` one list, a value per call) with one-time
    costs removed.

    Calls that save about the same bytes (``sizes``, within ``alike``) are taken as
    identical layers, which cost the same in a steady step. What happens once in a step
    lands in one call: the kernel selection for a shape not seen before (cuBLAS
    heuristics, cuDNN attention graphs) in the first call, growth of the host pool in
    the call that needs it. Among three or more alike calls, a time above
    ``one_time`` times their median is replaced by that median; other calls are
    kept as measured."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and sizes[i] <= settings.alike * max(sizes[groups[-1][0]], 1.0):
            groups[-1].append(i)
        else:
            groups.append([i])
    alike = [members for members in groups if len(members) >= 3]
    out = []
    for row in times:
        values = [float(t) for t in row]
        for members in alike:
            mid = sorted(values[i] for i in members)[len(members) // 2]
            for i in members:
                if values[i] > settings.one_time * mid:
                    values[i] = mid
        out.append(values)
    return out


def _most_crowded(points: list[Point]) -> Point:
    """The point whose nearest neighbour (in log tokens) is nearest: losing it narrows
    the fit's range the least. The smallest and largest sizes go last."""
    order = sorted(points, key=lambda p: (p.tokens, p.quad))
    if len(order) <= 2:
        return order[0]
    logs = [math.log(max(1, p.tokens)) + 1e-9 * math.log(max(1, p.quad)) for p in order]
    inner = range(1, len(order) - 1)
    return order[min(inner, key=lambda i: min(logs[i] - logs[i - 1], logs[i + 1] - logs[i]))]
