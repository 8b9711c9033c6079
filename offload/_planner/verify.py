"""The planner's check of its own choice: plans applied and measured on the user's step.

The cost model errs by a few percent in memory and leaves out host work, so
:func:`verified` applies the fastest predicted plans in turn until one's measured peak
fits the budget, then measures the plans predicted almost as fast, and the single-lever
plans that fit, and keeps the fastest measured. :func:`measure_step` is the one timed
loop every planner measurement goes through.

Note [equality of the levers]
Every layer lever (keep, offload without ``compress``, the recompute levers) gives
losses and gradients bitwise those of the step without levers: the planner's tests
compare them with ``torch.equal``. The model levers (``sliced_head``, ``tiled_mlp``:
``offload/_planner/model_levers.py``) compute the same sums in another order (the
head's weight gradient and the MLPs' parameter gradients are sums over slices or tiles,
in fp32), so a plan that holds one of them is equal to the step without levers only
within the tolerance that docs/long-context.md states and the tests hold: in fp32
element-wise within :data:`GRAD_RTOL` / :data:`GRAD_ATOL`, in bf16 within
:data:`GRAD_BF16_REL` of the largest gradient of each parameter. That rule, and the
bitwise one otherwise, is what :func:`equality` returns (``Plan.to_dict()["equality"]``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from offload._core import _measure
from offload._planner.costs import PlanCosts
from offload._planner.levers import OFFLOADED, SHORT, summary
from offload._planner.search import candidates, single_levers
from offload._planner.settings import DEFAULT_PLANNER, PlannerSettings

if TYPE_CHECKING:  # pragma: no cover
    from offload._planner.plan import Plan

__all__ = [
    "GRAD_ATOL",
    "GRAD_BF16_REL",
    "GRAD_RTOL",
    "equality",
    "measure_step",
    "verified",
]

#: The tolerance of a plan with model levers against the step without levers (Note
#: [equality of the levers]): fp32, element-wise ...
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-6
#: ... bf16: the largest difference over the largest magnitude of each gradient.
GRAD_BF16_REL = 2e-2

# Note [plan against the single lever]
# A plan of several levers is kept over the best single lever that fits only when its
# pooled median is at least verify_gain faster *and* its block was faster in each of
# the verify_rounds rounds (fields of PlannerSettings). When the plan chosen is not,
# the fastest pooled of the other plans measured that is takes its place (the test is
# against the single lever, not against the first plan); when none is, the single
# lever is the plan. Where the
# host paces the step, two configurations measured in alternation drift by a few
# percent from one block to the next, so a pooled lead can come from one block and be
# behind in the user's run; a lead in every round is one the drift did not make. The
# rounds only: the first measurements of the two are not adjacent in time. Between
# plans of several levers neither is the safe default: a rival replaces the model's
# choice when it leads it by verify_gain pooled, or by less in every round.


def equality(model_levers: Sequence[str]) -> dict[str, Any]:
    """How a plan's gradients compare with the step's without levers (Note [equality of
    the levers]): ``{"bitwise": True}`` without model levers, else the tolerance."""
    if not model_levers:
        return {"bitwise": True}
    return {
        "bitwise": False,
        "why": f"{', '.join(model_levers)} change the float summation order",
        "fp32": {"rtol": GRAD_RTOL, "atol": GRAD_ATOL},
        "bf16_relative_to_largest": GRAD_BF16_REL,
    }


def measure_step(step_fn: Callable[[], Any], steps: int, warmup: int) -> dict[str, Any]:
    """Median step seconds (CUDA events), the largest activation peak (allocated during
    the step above what was allocated before it: weights, gradients), every measured
    step's seconds (``"times"``) and host seconds to the step's return
    (``"host_times"``), from a settled state (:func:`offload._core._measure.settle`:
    every configuration is measured from the same state, so that their times compare)."""
    got = _measure.timed_steps(step_fn, steps, warmup)
    peak = got.activation
    return {
        "seconds": got.median,
        "peak_bytes": float(peak) if peak is not None else None,
        "times": list(got.seconds),
        "host_times": list(got.host),
    }


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _every_round(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a``'s block was faster than ``b``'s in every round."""
    return all(x < y for x, y in zip(a["rounds"], b["rounds"]))


def _ahead(plan: dict[str, Any], single: dict[str, Any], gain: float) -> bool:
    """Whether ``plan`` stays over the best single lever (Note [plan against the single
    lever]): ``gain`` (a fraction) faster pooled, and faster in every round."""
    if plan is single:
        return True
    if plan["pooled_seconds"] > single["pooled_seconds"] * (1.0 - gain):
        return False
    return _every_round(plan, single)


def _leads(rival: dict[str, Any], chosen: dict[str, Any], gain: float) -> bool:
    """Whether ``rival`` replaces the model's choice (Note [plan against the single
    lever]): ``gain`` (a fraction) faster pooled, or faster pooled and in every round."""
    if rival is chosen or rival["pooled_seconds"] >= chosen["pooled_seconds"]:
        return False
    if rival["pooled_seconds"] < chosen["pooled_seconds"] * (1.0 - gain):
        return True
    return _every_round(rival, chosen)


def verified(
    costs: PlanCosts,
    limit: float,
    allowed: Sequence[str],
    make: Callable[[list[str]], Plan],
    step_fn: Callable[[], Any] | None,
    model: torch.nn.Module | None,
    steps: int = 3,
    settings: PlannerSettings = DEFAULT_PLANNER,
) -> tuple[list[str], list[dict[str, Any]]]:
    """The plan to use: the fastest *measured* of the plans that fit ``limit`` among
    the model's fastest predictions, never slower than the best single lever that fits.
    The counts and fractions named below are fields of ``settings``
    (:class:`PlannerSettings`).

    Fit first. The model's choice is applied and ``steps`` steps measured (after
    ``verify_warmup``). When its peak exceeds the budget, the model has
    under-predicted that plan by ``measured - predicted``; the search runs again for a
    budget lowered by half that error after the first miss and by the largest error
    seen after later ones (plans that fit only within that room are passed over, not
    tried one by one) and the fastest plan not yet tried is measured next, at most
    ``verify_candidates`` in all; when no plan is predicted to fit with that room,
    the next plan of the first ranking is tried.

    Then speed. The model leaves out what it cannot see (the host's work for offloaded
    tensors and selective layers, which costs device time at a step's start, when no
    device work is queued), so plans it ranks within a few percent can measure in
    another order. The next ``verify_rivals`` plans of the same ranking predicted
    within ``verify_close`` of the one that fits are measured too, and when the
    one that fits offloads and measured slower than predicted (``verify_excess``),
    the fastest plan predicted with that excess charged to offloading.

    Then the guarantee (``verify_single``). Every single-lever plan predicted to fit
    (:func:`~offload._planner.search.single_levers`) is measured; the fastest that
    fits when measured is the one to beat. When no plan of the first two parts fits,
    it is the plan.

    When more than one plan fits, every plan that fits is measured again in
    ``verify_rounds`` rounds of alternating order, its steps pooled: a rival
    replaces the model's choice when it is ``verify_gain`` faster, or faster by
    less in every round; the plan must be ``verify_gain`` faster than the best
    single lever and faster in every round to stay; otherwise the fastest other plan
    measured that is takes its place, and when none is, the single lever is the plan
    (Note [plan against the single lever]).

    Without ``step_fn`` the model's choice is returned unchecked. Every measurement is
    in the returned checks (``"rival": True`` or ``"corrected": True`` for the second
    part; ``"single"``: the name of the single lever for the third; ``"times"``: every
    measured step; ``"pooled_seconds"``: the median of those, for the plans measured in
    rounds; ``"rounds"``: the median of each round's block)."""
    ranked = candidates(costs, limit, allowed, settings)
    if step_fn is None:
        return ranked[0][1], []
    run = _Verification(costs, limit, allowed, make, step_fn, model, steps, settings)
    return run.choose(ranked), run.checks


class _Verification:
    """The measured steps of one :func:`verified` call."""

    def __init__(
        self,
        costs: PlanCosts,
        limit: float,
        allowed: Sequence[str],
        make: Callable[[list[str]], Plan],
        step_fn: Callable[[], Any],
        model: torch.nn.Module | None,
        steps: int,
        settings: PlannerSettings,
    ) -> None:
        self.costs, self.limit, self.allowed = costs, limit, allowed
        self.settings = settings
        self.make, self.step_fn, self.model, self.steps = make, step_fn, model, steps
        self.checks: list[dict[str, Any]] = []
        self.tried: dict[tuple[str, ...], dict[str, Any]] = {}

    def measure(self, levers: list[str]) -> dict[str, Any]:
        applied = self.make(levers).apply(self.model)
        try:
            got = measure_step(self.step_fn, self.steps, self.settings.verify_warmup)
        finally:
            applied.remove()
        return {**got, "compressed": applied.compressed}

    def trial(self, predicted: float, levers: list[str], **kind: Any) -> dict[str, Any]:
        got = self.measure(levers)
        check = {
            "levers": levers,
            "predicted_seconds": predicted,
            "predicted_bytes": self.costs.memory(levers),
            "measured_seconds": got["seconds"],
            "measured_bytes": got["peak_bytes"],
            "fits": got["peak_bytes"] <= self.limit,
            "rival": False,
            "times": list(got["times"]),
            **kind,
        }
        if got.get("compressed") is not None:
            check["compressed"] = got["compressed"]
        self.tried[tuple(levers)] = check
        self.checks.append(check)
        return check

    def choose(self, first: list[tuple[float, list[str]]]) -> list[str]:
        s = self.settings
        chosen, ranked, margin = self.fit(first)
        fitting = [] if chosen is None else [chosen]
        if chosen is not None:
            close = chosen["predicted_seconds"] * (1.0 + s.verify_close)
            rivals = [(t, lv) for t, lv in ranked if tuple(lv) not in self.tried and t <= close]
            for predicted, levers in rivals[: s.verify_rivals]:
                check = self.trial(predicted, levers, rival=True)
                if check["fits"]:
                    fitting.append(check)
            corrected = self.corrected(chosen)
            if corrected is not None and corrected["fits"]:
                fitting.append(corrected)
        single = self.best_single() if s.verify_single else None
        if chosen is None:
            if single is None:
                _raise_none_fits(self.checks, self.limit, margin)
            return single["levers"]
        if single is not None and all(c is not single for c in fitting):
            fitting.append(single)
        if len(fitting) > 1:
            for check in fitting:
                check["rounds"] = []
            for r in range(s.verify_rounds):
                for check in fitting[::-1] if r % 2 == 0 else fitting:
                    got = self.measure(check["levers"])
                    check["times"] += got["times"]
                    check["rounds"].append(got["seconds"])
            for check in fitting:
                check["pooled_seconds"] = _median(check["times"])
            contenders = [c for c in fitting if c is not single or c is chosen]
            best = min(contenders, key=lambda c: c["pooled_seconds"])
            if _leads(best, chosen, s.verify_gain):
                chosen = best
            if single is not None and not _ahead(chosen, single, s.verify_gain):
                ahead = [c for c in contenders if _ahead(c, single, s.verify_gain)]
                chosen = min(ahead, key=lambda c: c["pooled_seconds"]) if ahead else single
        return chosen["levers"]

    def fit(
        self, first: list[tuple[float, list[str]]]
    ) -> tuple[dict[str, Any] | None, list[tuple[float, list[str]]], float]:
        """The first part of :func:`verified`: the check of the first plan that fits
        (``None`` when none of those tried does), the ranking it came from, and the
        largest error seen."""
        ranked = first
        margin = 0.0
        misses = 0
        while len(self.checks) < self.settings.verify_candidates:
            if margin > 0:
                # half the error seen after the first miss (one plan's error overstates
                # the others': the next plans err less, in either direction), the whole
                # of it after the next
                room = margin / 2 if misses == 1 else margin
                try:
                    ranked = candidates(self.costs, self.limit - room, self.allowed, self.settings)
                except ValueError:
                    # nothing is predicted to fit with that much room (the error was
                    # that plan's, not every plan's): the next of the first ranking
                    ranked = first
            todo = [(t, levers) for t, levers in ranked if tuple(levers) not in self.tried]
            if not todo:
                break
            check = self.trial(*todo[0])
            if check["fits"]:
                return check, ranked, margin
            misses += 1
            margin = max(margin, check["measured_bytes"] - check["predicted_bytes"])
        return None, ranked, margin

    def corrected(self, chosen: dict[str, Any]) -> dict[str, Any] | None:
        """The check of the fastest plan predicted with the offloading cost that
        ``chosen``'s excess over its prediction implies (``settings.verify_excess``), or
        ``None`` when there is no such excess or that plan was measured already."""
        costs = self.costs
        weight = sum(costs.share(x) for x in chosen["levers"] if x in OFFLOADED)
        excess = chosen["measured_seconds"] - chosen["predicted_seconds"]
        if weight <= 0 or excess <= self.settings.verify_excess * chosen["predicted_seconds"]:
            return None
        extra = excess / weight  # seconds per layer's worth of offloaded bytes
        base = costs.offload_s or (0.0,) * costs.num_layers
        costs = dataclasses.replace(costs, offload_s=tuple(s + extra for s in base))
        try:
            ranked = candidates(costs, self.limit, self.allowed, self.settings)
        except ValueError:
            return None
        todo = [(t, levers) for t, levers in ranked if tuple(levers) not in self.tried]
        if not todo:
            return None
        return self.trial(*todo[0], corrected=True)

    def best_single(self) -> dict[str, Any] | None:
        """The guarantee: every single-lever plan predicted to fit, measured (those not
        measured yet); the fastest that fits when measured, or ``None``."""
        fits = []
        for name, levers in single_levers(self.costs, self.allowed, self.settings):
            if self.costs.memory(levers) > self.limit:
                continue
            check = self.tried.get(tuple(levers))
            if check is None:
                check = self.trial(self.costs.seconds(levers), levers, single=name)
            else:
                check["single"] = name
            if check["fits"]:
                fits.append(check)
        return min(fits, key=lambda c: c["measured_seconds"]) if fits else None


def _raise_none_fits(checks: list[dict[str, Any]], limit: float, margin: float) -> NoReturn:
    if not checks:
        raise ValueError(f"budget={limit / 2**30:.3f} GiB: no plan to measure")
    worst = min(checks, key=lambda c: c["measured_bytes"])
    tried_text = "; ".join(
        f"({' '.join(SHORT[x] for x in c['levers'])}) predicted "
        f"{c['predicted_bytes'] / 2**30:.3f}, measured {c['measured_bytes'] / 2**30:.3f} GiB"
        for c in checks
    )
    raise ValueError(
        f"budget={limit / 2**30:.3f} GiB: the {len(checks)} plans tried (the fastest "
        f"predicted to fit, then the fastest predicted to fit with room for the model's "
        f"error, {margin / 2**30:.3f} GiB) measured above it (lowest "
        f"{worst['measured_bytes'] / 2**30:.3f} GiB, levers {summary(worst['levers'])}); "
        f"raise the budget. Tried: {tried_text}"
    )
