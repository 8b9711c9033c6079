"""The levers outside the layers' own levers that a plan may add: the language-model head
and its loss in slices (``"sliced_head"``: :func:`offload.sliced_head_loss`) and every
layer's MLP tiled along the sequence (``"tiled_mlp"``: :func:`offload.tile_mlp`).

They act on the whole model, not on one layer: the head lever cuts what no layer lever
touches (the ``tokens x vocab`` logits in fp32, their softmax and gradient: ``H`` of
``offload/_planner/costs.py``), the tiling cuts what a layer saves and the working set
of its forward and of its recompute (the MLP's ``tokens x ffn`` intermediates). A plan
holds one set of them (:attr:`offload.Plan.model_levers`); :func:`offload.plan`
measures the step with each set that is a candidate and plans with each (the cost
model of that set: ``offload/_planner/fit.py``), and takes a set only where the budget
needs it (no plan without model levers meets it): the plan stays bitwise wherever it
can. Of the sets that do, fewer levers unless more are predicted
``settings.model_lever_gain`` faster.

Equality: both change the float summation order (Note [equality of the levers] in
``offload/_planner/verify.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from torch import nn

from offload._planner.costs import PlanCosts
from offload._planner.search import candidates
from offload._planner.settings import DEFAULT_PLANNER, PlannerSettings
from offload._recompute._head import _find_causal_lm, sliced_head_loss
from offload._recompute._tiled import tile_mlp

__all__ = [
    "MODEL_LEVERS",
    "TILED_LAYER_LEVERS",
    "ModelLeverSet",
    "check_head_model",
    "check_model_levers",
    "describe",
    "head_model",
    "lever_candidates",
    "not_candidates",
    "pick_measured",
    "layer_levers_with",
    "ranked_variants",
    "variants",
]

#: The model levers (each usable alone or with the other).
MODEL_LEVERS = ("sliced_head", "tiled_mlp")

#: The layer levers a plan with ``"tiled_mlp"`` may use. The selective levers keep the
#: outputs of matrix products, which inside a tiled MLP are every tile's intermediates:
#: all that the tiling frees, kept again.
TILED_LAYER_LEVERS = ("keep", "offload", "checkpoint", "checkpoint_offload")

#: What each model lever does, for the report.
_WHAT = {
    "sliced_head": "LM head and loss in slices (offload.sliced_head_loss)",
    "tiled_mlp": "MLPs tiled along the sequence (offload.tile_mlp)",
}


def check_model_levers(model_levers: Sequence[str], name: str) -> tuple[str, ...]:
    """``model_levers`` as a tuple in :data:`MODEL_LEVERS` order; ``TypeError`` or
    ``ValueError`` naming ``name``."""
    if isinstance(model_levers, str) or not isinstance(model_levers, Sequence):
        raise TypeError(f"{name} must be a sequence of model lever names; got {model_levers!r}")
    bad = [x for x in model_levers if x not in MODEL_LEVERS]
    if bad:
        raise ValueError(
            f"{name}: unknown model lever(s) {bad}; accepted: {', '.join(MODEL_LEVERS)}"
        )
    return tuple(x for x in MODEL_LEVERS if x in model_levers)


def check_head_model(model_levers: Sequence[str], head_model: nn.Module | None) -> None:
    """``ValueError`` where ``model_levers`` has ``"sliced_head"`` and ``head_model`` is
    ``None`` (the head lever needs the Hugging Face causal LM)."""
    if "sliced_head" in model_levers and head_model is None:
        raise ValueError(
            "model_levers has 'sliced_head' but head_model is None: pass the Hugging "
            "Face causal LM whose head and loss are computed in slices"
        )


def variants(candidates: Sequence[str]) -> list[tuple[str, ...]]:
    """Every set of the model levers ``candidates``, the empty one first, smaller sets
    before larger ones."""
    ordered = check_model_levers(candidates, "model_levers")
    return [c for n in range(len(ordered) + 1) for c in itertools.combinations(ordered, n)]


def layer_levers_with(model_levers: Sequence[str], allowed: Sequence[str]) -> tuple[str, ...]:
    """The layer levers of ``allowed`` a plan with ``model_levers`` may use."""
    if "tiled_mlp" in model_levers:
        return tuple(x for x in allowed if x in TILED_LAYER_LEVERS)
    return tuple(allowed)


def describe(model_levers: Sequence[str]) -> str:
    """``"LM head and loss in slices (offload.sliced_head_loss), ..."``, or ``""``."""
    return ", ".join(_WHAT[x] for x in model_levers)


def head_model(
    model: nn.Module | None, layers: Sequence[nn.Module]
) -> tuple[nn.Module | None, str]:
    """The Hugging Face causal LM (a ``*ForCausalLM``, or one inside a PEFT model) in
    ``model`` that holds ``layers`` and whose head and loss
    :func:`offload.sliced_head_loss` computes in slices, and ``""``; or ``None`` and why
    the head lever is not a candidate (the model is not such a causal LM, its head is
    not an ``nn.Linear``, its loss is its own, ...: the checks of ``sliced_head_loss``,
    installed once and removed)."""
    if model is None:
        return None, "no model: pass model= (the Hugging Face causal LM)"
    try:
        causal = _find_causal_lm(model)
    except TypeError as exc:
        return None, str(exc)
    inside = {id(m) for m in causal.modules()}
    if not all(id(layer) in inside for layer in layers):
        return None, f"{type(causal).__name__} does not hold the layers planned"
    try:
        handle = sliced_head_loss(causal)
    except (TypeError, ValueError, ImportError) as exc:
        return None, str(exc)
    handle.remove()
    return causal, ""


class ModelLeverSet:
    """The model levers of one plan on a model: :meth:`apply` installs them
    (``sliced_head_loss`` on ``causal``, ``tile_mlp`` on ``layers``), :meth:`remove`
    restores the model (idempotent). ``handles``: what the calls returned, by lever."""

    def __init__(
        self,
        model_levers: Sequence[str],
        layers: Sequence[nn.Module],
        causal: nn.Module | None,
        *,
        slice_tokens: int | str = "auto",
        tile_tokens: int | str = "auto",
    ) -> None:
        self.model_levers = check_model_levers(model_levers, "model_levers")
        check_head_model(self.model_levers, causal)
        self.layers = list(layers)
        self.causal = causal
        self.slice_tokens = slice_tokens
        self.tile_tokens = tile_tokens
        self.handles: dict[str, Any] = {}

    def apply(self) -> ModelLeverSet:
        try:
            if "sliced_head" in self.model_levers:
                assert self.causal is not None  # checked in __init__
                self.handles["sliced_head"] = sliced_head_loss(
                    self.causal, slice_tokens=self.slice_tokens
                )
            if "tiled_mlp" in self.model_levers:
                self.handles["tiled_mlp"] = tile_mlp(self.layers, tile_tokens=self.tile_tokens)
        except BaseException:
            self.remove()
            raise
        return self

    def calls(self) -> dict[str, int]:
        """Per lever applied, the forward calls it acted on so far."""
        return {name: int(h.calls) for name, h in self.handles.items()}

    def remove(self) -> None:
        for name in reversed(list(self.handles)):
            self.handles.pop(name).remove()

    def __enter__(self) -> ModelLeverSet:
        return self.apply()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def ranked_variants(
    variants: dict[tuple[str, ...], PlanCosts],
    limit: float,
    allowed: Sequence[str],
    settings: PlannerSettings = DEFAULT_PLANNER,
) -> list[PlanCosts]:
    """The cost models of the sets of model levers in ``variants`` whose plans can meet
    ``limit``, in the order to try them. Where the set of none can, it alone: a model
    lever changes the float summation order, so it goes in only where the budget needs
    it (Note [equality of the levers]). Otherwise those whose fastest predicted plan is
    within ``settings.model_lever_gain`` of the fastest of all, fewest levers first,
    then the others, fastest first.

    Raises:
        ValueError: no set has a plan that fits; the message is the search's for the
            set of the most levers (the lowest floor), naming the set.
    """
    feasible: list[tuple[float, tuple[str, ...], PlanCosts]] = []
    errors: list[tuple[tuple[str, ...], ValueError]] = []
    for key, costs in variants.items():
        try:
            ranked = candidates(costs, limit, layer_levers_with(key, allowed), settings)
        except ValueError as exc:
            errors.append((key, exc))
            continue
        feasible.append((ranked[0][0], key, costs))
    if not feasible:
        key, first = max(errors, key=lambda e: len(e[0]))
        raise ValueError(f"{first} (model levers: {describe(key) or 'none'})") from None
    bitwise = [c for _, key, c in feasible if not key]
    if bitwise:
        return bitwise
    fastest = min(t for t, _, _ in feasible)
    near = [f for f in feasible if f[0] <= fastest * (1.0 + settings.model_lever_gain)]
    near.sort(key=lambda f: (len(f[1]), f[0]))
    rest = sorted((f for f in feasible if f not in near), key=lambda f: f[0])
    return [c for _, _, c in near + rest]


def lever_candidates(
    model: nn.Module, layers: list[nn.Module], wanted: Sequence[str]
) -> tuple[nn.Module | None, dict[str, str]]:
    """The causal LM of the head lever (or ``None``) and, per model lever asked for,
    why it is not a candidate (``""``: it is)."""
    why = {name: "" for name in wanted}
    causal = None
    if "sliced_head" in why:
        causal, why["sliced_head"] = head_model(model, layers)
    if "tiled_mlp" in why and not all(
        isinstance(getattr(layer, "mlp", None), nn.Module) for layer in layers
    ):
        why["tiled_mlp"] = (
            "not every layer has an mlp child (tile_mlp tiles a position-wise module; a "
            "whole layer, attention included, is not one)"
        )
    return causal, why


def not_candidates(measured: dict[str, Any]) -> str:
    """``"; model levers not candidates: sliced_head (why)"``, or ``""``."""
    why = {k: v for k, v in measured.get("model_levers", {}).items() if v}
    if not why:
        return ""
    return "; model levers not candidates: " + "; ".join(f"{k} ({v})" for k, v in why.items())


def pick_measured(
    done: list[tuple[PlanCosts, list[str], list[dict[str, Any]]]],
    settings: PlannerSettings = DEFAULT_PLANNER,
) -> tuple[PlanCosts, list[str], list[dict[str, Any]]]:
    """Of the verified plans of up to two sets of model levers (``(costs, levers,
    checks)``, in :func:`ranked_variants` order), the one to keep: the set of fewer
    levers unless the other measured at least ``settings.model_lever_gain`` faster (each
    plan's pooled median, or its median where it was measured in one block)."""

    def seconds(item: tuple[PlanCosts, list[str], list[dict[str, Any]]]) -> float:
        _, levers, checks = item
        times = [
            c.get("pooled_seconds", c["measured_seconds"])
            for c in checks
            if c["levers"] == levers and c["fits"]
        ]
        return min(times) if times else float("inf")

    if len(done) == 1:
        return done[0]
    few, many = sorted(done, key=lambda d: len(d[0].model_levers))
    if seconds(many) < seconds(few) * (1.0 - settings.model_lever_gain):
        return many
    return few
