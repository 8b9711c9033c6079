"""The planner's tuning, chosen once and passed in: :class:`PlannerSettings`."""

from __future__ import annotations

import dataclasses

from offload.activations._auto._settings import check_field

__all__ = ["DEFAULT_PLANNER", "PlannerSettings"]


@dataclasses.dataclass(frozen=True)
class PlannerSettings:
    """How :func:`offload.plan` measures, searches and verifies (defaults: what the
    benchmarks of docs/performance.md were measured with). Frozen; checked at
    construction (``TypeError``/``ValueError`` naming the field).

    Measuring (``offload/_planner/fit.py``):

    - ``cost_steps``: steps, at most, of the measuring ``"auto"`` offloader that gives
      the per-layer costs. Its first step is the coldest of the process (pinned host
      memory allocated, kernels chosen), whose layer times can be many times the warm
      ones; ``"auto"`` measures again, warm, within its next two steps, and the step
      after that reports the warm costs. Costs are taken once two consecutive warm
      reports agree, else from the last report.
    - ``cost_agree``: fraction; two consecutive warm reports agree when each layer's
      seconds differ by at most this share of the larger.
    - ``scheme_rounds``: rounds of measuring both full-recompute schemes, in turn.
    - ``scheme_tie``: fraction; step times of the two schemes closer than this are a
      tie, which the one with less host time wins.

    Searching (``offload/_planner/search.py``):

    - ``polished``: count of the fastest family plans improved layer by layer (those
      that differ from each other in more than two layers).
    - ``full_search``: layers up to which every family is tried; with more, every
      ``ceil(L / full_search)``-th count of each lever first, then every count near
      the ``refined`` fastest families.
    - ``refined``: count of the fastest strided families searched around.
    - ``compress_gain``: fraction; a layer travels compressed only when that lowers the
      predicted step by more than this share (compression is lossy: a gain within the
      model's noise is not one).
    - ``hidden_slowdown``: fraction; "offload all that hides" is the most layers
      offloaded (a prefix, as ``offload_layers="auto"`` chooses them) whose predicted
      step is within this share of the step without levers (``"auto"``'s default
      ``max_slowdown``).

    Verifying (``offload/_planner/verify.py``; Note [plan against the single lever]):

    - ``verify_candidates``: plans applied and measured, at most, until one fits.
    - ``verify_rivals``: once a plan fits, the next fastest predicted plans (its
      "rivals") measured too, at most ...
    - ``verify_close``: fraction; ... those predicted at most this share slower than
      the plan that fits ...
    - ``verify_rounds``: ... and when one of them fits too, the plans that fit are
      measured again in this many more rounds, each in the reverse order of the one
      before, each plan's steps pooled: a plan measured once, right after another,
      differs from its measurement in alternation with the others by more than the
      gaps being judged (the device's speed drifts over a few steps, and a fresh
      offloader's first steps allocate) ...
    - ``verify_gain``: fraction; ... and a rival replaces the model's choice when its
      pooled median is at least this share faster (about the spread of one plan's
      pooled medians between runs), or faster by less and faster in every round.
    - ``verify_excess``: fraction; when the plan that fits offloads and measures more
      than this share slower than predicted, the excess is taken for the host's work
      for offloaded tensors, which the model leaves out (on a step the host paces it
      costs device time): it is spread over the plan's offloaded layers by the share of
      their bytes each sends, added to every layer's offloading cost
      (``PlanCosts.offload_s``), and the fastest plan predicted with those costs is
      measured too (``"corrected": True``).
    - ``verify_single``: whether the single-lever plans that fit
      (:func:`~offload._planner.search.single_levers`) are measured and the fastest of
      them taken when it measures faster than the plan chosen: the guarantee that a
      plan is never slower than the obvious choice.
    - ``verify_warmup``: unmeasured steps before each measured block (the allocator's
      cache is emptied before each block, and a plan applied anew makes a new
      offloader, whose first steps allocate).

    Levers outside the layers (``offload/_planner/model_levers.py``):

    - ``model_lever_gain``: fraction; where the budget needs model levers (no plan
      without them meets it), a set of more is taken over a set of fewer only where
      its plan is predicted (then measured) at least this share faster.
    """

    cost_steps: int = 8
    cost_agree: float = 0.1
    scheme_rounds: int = 2
    scheme_tie: float = 0.03
    polished: int = 6
    full_search: int = 16
    refined: int = 8
    compress_gain: float = 1e-3
    hidden_slowdown: float = 0.03
    verify_candidates: int = 6
    verify_rivals: int = 3
    verify_close: float = 0.03
    verify_rounds: int = 2
    verify_gain: float = 0.01
    verify_excess: float = 0.03
    verify_single: bool = True
    verify_warmup: int = 2
    model_lever_gain: float = 0.01

    def __post_init__(self) -> None:
        for name, kind, low, high in (
            ("cost_steps", int, 1, None),
            ("cost_agree", float, 0.0, None),
            ("scheme_rounds", int, 1, None),
            ("scheme_tie", float, 0.0, None),
            ("polished", int, 0, None),
            ("full_search", int, 1, None),
            ("refined", int, 1, None),
            ("compress_gain", float, 0.0, 1.0),
            ("hidden_slowdown", float, 0.0, None),
            ("verify_candidates", int, 1, None),
            ("verify_rivals", int, 0, None),
            ("verify_close", float, 0.0, None),
            ("verify_rounds", int, 1, None),
            ("verify_gain", float, 0.0, 1.0),
            ("verify_excess", float, 0.0, None),
            ("verify_warmup", int, 0, None),
            ("model_lever_gain", float, 0.0, 1.0),
        ):
            check_field("PlannerSettings", name, getattr(self, name), kind, low, high)
        if not isinstance(self.verify_single, bool):
            raise TypeError(f"PlannerSettings.verify_single={self.verify_single!r}: expected bool")


#: The settings :func:`offload.plan` uses unless given others.
DEFAULT_PLANNER = PlannerSettings()
