"""The tuning of ``offload_layers="auto"``, chosen once and passed in: :class:`AutoSettings`."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DEFAULT_AUTO", "AutoSettings", "check_field"]


def check_field(
    owner: str, name: str, value: Any, kind: type, low: float, high: float | None = None
) -> None:
    """``owner.name`` is a ``kind`` (an int passes for a float, a bool for neither)
    within ``[low, high]``: else ``TypeError`` or ``ValueError`` naming it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not isinstance(value, int))
    ):
        raise TypeError(f"{owner}.{name}={value!r}: expected {kind.__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{owner}.{name}={value!r}: expected a value {bound}")


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    """How the ``"auto"`` policy measures, verifies and remembers (defaults: what the
    benchmarks of docs/performance.md were measured with). Frozen; checked at
    construction (``TypeError``/``ValueError`` naming the field). A step counts one
    forward and its backward.

    Verifying (``offload/activations/_auto/_family.py``):

    - ``verify_steps``: pairs (a step without offloading, then one of the choice) per
      verification round, at most; also the steps without offloading kept.
    - ``min_pairs``: pairs after which a round decides when every pair's ratio is on
      the same side of the limit.
    - ``warmup_steps``: steps of the choice not counted after a measuring forward.
    - ``change_warmup_steps``: steps of the choice not counted after it changes.
    - ``watch_steps``: steps of the choice whose median ratio is watched once settled.
    - ``residuals``: measured/predicted step-time ratios kept per kind of step (their
      median scales the predicted compute).
    - ``prediction_tolerance``: fraction; a step whose measured/predicted ratio is this
      far from the median of those before it was predicted wrong: measured again.
    - ``max_decisions``: input sizes whose costs and decisions are kept per kind of
      input (the last used).
    - ``rescale``: fraction; a change of the scale by more than this re-decides.
    - ``step_up_reach``: a multiple of ``max_slowdown``; a verified choice takes one
      more layer when the prediction for it is within ``1 + step_up_reach *
      max_slowdown``.

    Fitting costs across sizes (``offload/activations/_auto/_fit.py``):

    - ``max_points``: input sizes measured and kept per kind of input.
    - ``extrapolation``: a factor in tokens beyond the sizes measured within which a
      prediction is trusted.
    - ``alike``: a factor; calls whose saved bytes differ by less are alike.
    - ``one_time``: a multiple; a call's time above this times the median over alike
      calls is a one-time cost.

    The policy (``offload/activations/_auto/_policy.py``):

    - ``watch_every``: once settled, one step in this many is timed.
    - ``memory_margin``: fraction of the device memory limit kept free
      (fragmentation, what the model misses).
    - ``max_families``: kinds of input remembered, least recently used dropped first.
    - ``max_pending``: steps whose times are not read yet; older ones are dropped.
    - ``calibrate_room``: fraction; the step after the first runs without offloading
      only when its predicted peak is within this share of the memory limit.

    Prediction (``offload/activations/_auto/_predict.py``):

    - ``host_seconds_per_copy``: host seconds offloading adds per copy (pack, release,
      reload, unpack, free in Python); fitted on an H200 host on tiny48 (48 small
      layers, launch-bound: about 90 ms for 423 copies a step). It costs step time only
      where the host, not the device, sets the pace.
    """

    verify_steps: int = 5
    min_pairs: int = 3
    warmup_steps: int = 2
    change_warmup_steps: int = 1
    watch_steps: int = 5
    residuals: int = 8
    prediction_tolerance: float = 0.10
    max_decisions: int = 16
    rescale: float = 0.05
    step_up_reach: float = 3.0
    max_points: int = 6
    extrapolation: float = 1.25
    alike: float = 1.25
    one_time: float = 2.0
    watch_every: int = 4
    memory_margin: float = 0.05
    max_families: int = 8
    max_pending: int = 8
    calibrate_room: float = 0.8
    host_seconds_per_copy: float = 2.0e-4

    def __post_init__(self) -> None:
        for name, kind, low, high in (
            ("verify_steps", int, 1, None),
            ("min_pairs", int, 1, None),
            ("warmup_steps", int, 0, None),
            ("change_warmup_steps", int, 0, None),
            ("watch_steps", int, 1, None),
            ("residuals", int, 1, None),
            ("prediction_tolerance", float, 0.0, None),
            ("max_decisions", int, 1, None),
            ("rescale", float, 0.0, None),
            ("step_up_reach", float, 0.0, None),
            ("max_points", int, 2, None),
            ("extrapolation", float, 1.0, None),
            ("alike", float, 1.0, None),
            ("one_time", float, 1.0, None),
            ("watch_every", int, 1, None),
            ("memory_margin", float, 0.0, 0.99),
            ("max_families", int, 1, None),
            ("max_pending", int, 1, None),
            ("calibrate_room", float, 0.0, 1.0),
            ("host_seconds_per_copy", float, 0.0, None),
        ):
            check_field("AutoSettings", name, getattr(self, name), kind, low, high)
        if self.min_pairs > self.verify_steps:
            raise ValueError(
                f"AutoSettings.min_pairs={self.min_pairs} exceeds verify_steps="
                f"{self.verify_steps}: a round decides within verify_steps pairs"
            )


#: The settings an ``"auto"`` offloader uses unless given others.
DEFAULT_AUTO = AutoSettings()
