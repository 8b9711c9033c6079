"""What the ``offload_layers="auto"`` policy reads off a step and writes back: the first
call's inputs as a family key (:func:`describe`), the predicted time of a prefix
(:func:`predicted`) and what ``OffloadStats.auto`` says of a decided step
(:func:`step_stats`)."""

from __future__ import annotations

from typing import Any

import torch

from offload.activations._auto import _predict as _auto
from offload.activations._auto._family import Family, Memory, Run, Sized, StepRecord
from offload.activations._auto._fit import Estimate, sizes

__all__ = ["describe", "predicted", "step_stats"]


def describe(inputs: Any) -> tuple[Any, int, int, torch.device] | None:
    """``(family key, tokens, quad, device)`` of the first layer call's inputs; ``None``
    when they hold no tensor."""
    args, kwargs = inputs
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    if not tensors:
        return None
    first = tensors[0]
    key = (
        tuple((t.dim(), t.dtype, t.device) for t in tensors),
        int(first.shape[-1]) if first.dim() else 0,
    )
    n, q = sizes(tuple(first.shape))
    return key, n, q, first.device


def predicted(
    sized: Sized, k: int, d2h: float, h2d: float, prefetch: int | None, per_copy: float
) -> float:
    """The unscaled predicted seconds of a step offloading the first ``k`` calls
    (``per_copy``: :func:`~offload.activations._auto._predict.predict_step`'s)."""
    got = sized.predicted.get(k)
    if got is None:
        est = sized.est
        got = sized.predicted[k] = _auto.predict_step(
            est.costs, range(k), d2h, h2d, prefetch, est.gap_s, per_copy
        )
    return got


def step_stats(
    fam: Family,
    record: StepRecord,
    decision: _auto.AutoDecision,
    est: Estimate,
    mem: Memory | None,
    state: dict[str, int],
) -> dict[str, Any]:
    """What ``OffloadStats.auto`` says of one decided step (``state``: the policy's sizes)."""
    run = record.run
    out: dict[str, Any] = {
        "phase": fam.phase.value,
        "step": run.value,
        "offloaded": list(range(record.offloaded)),
        "chosen": list(decision.offloaded),
        "tokens": record.tokens,
        "exact": est.exact,
        "scale": fam.scale,
        "measured_ratio": fam.measured_ratio,
        # the costs come from the offloader's first (cold) step alone
        "cold": fam.model is not None and all(p.cold for p in fam.model.points),
        "verification": fam.note,
        "memory": None if mem is None else mem.to_dict(),
        "state": state,
    }
    if run is Run.NONE and decision.offloaded:
        out["reason"] = (
            f"verifying: this step runs without offloading, in alternation with the "
            f"choice ({decision.reason})"
        )
    elif run is Run.PROBE:
        out["reason"] = f"measuring this size again at the choice's plan: {decision.reason}"
    return out
