"""The plan (one lever per layer: :class:`Plan`) and :func:`plan`, which measures the
user's step, fits the cost model (``offload/_planner/costs.py``) to it, searches
(``search.py``) and checks the choice by measuring it (``verify.py``).

Levers (:data:`~offload._planner.levers.LEVERS`):

* ``"keep"``: nothing; the layer's saved activations stay on the device.
* ``"offload"``: :class:`offload.ActivationOffloader` copies them to host memory
  (compressed with ``compress="fp8"`` when the plan is made with it).
* ``"selective"``: selective recompute (``torch.utils.checkpoint`` with a pair of
  dispatch modes, like PyTorch's ``create_selective_checkpoint_contexts``): the outputs
  of matrix products and attention are kept, everything else (norms, activations, the
  gated product, casts) is recomputed in backward. Outputs the recompute never reaches
  (it stops after the last tensor the backward needs: in a transformer block, the MLP's
  down projection) are not kept from the layer's second step on (``KeptKeys``).
* ``"checkpoint"``: full recompute; only the layer's inputs are kept.
* ``"checkpoint_offload"``: full recompute whose inputs (all the checkpoint keeps) are
  offloaded: the layer keeps nothing on the device between its forward and its
  backward, and the link carries only its inputs (a few percent of its activations).
* ``"selective_offload_inputs"``: selective recompute whose inputs are offloaded: the
  kept outputs stay on the device, the link carries only the inputs.
* ``"selective_offload"``: selective recompute whose kept tensors (the matrix products'
  and attention's outputs) are offloaded like an ``"offload"`` layer's: the recompute
  frees the cheap part, the link carries only what is expensive to recompute. Torch's
  selective checkpointing keeps those outputs where saved-tensor hooks cannot see them,
  so the selective levers have their own pair of dispatch modes (``KeepOutputs``,
  ``RecomputeFromKept``), which here hand them to the offloader and take them back.
  The layer's inputs, which the checkpoint saves through the saved-tensor hooks, travel
  too.

The three offloaded recompute levers put their layer in the offloader's
``offload_layers``: what the checkpoint saves through saved-tensor hooks (its inputs)
goes to the offloader like any saved tensor of an offloaded layer, on the same release
and reload schedule. The two that send only the inputs may take the last layer (its
group is released at its close, before the head and the loss); ``"offload"`` and
``"selective_offload"`` may not (:data:`~offload._planner.levers.NOT_LAST`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload._planner.costs import PlanCosts
from offload._planner.fit import (
    find_model,
    fit_costs,
    measure_configs,
    measure_model_levers,
    variant_costs,
)
from offload._planner.levers import (
    DEFAULT_LEVERS,
    LEVERS,
    NOT_LAST,
    OFFLOADED,
    RECOMPUTED,
    CompressedLayers,
    KeptKeys,
    Recompute,
    check_levers,
    summary,
)
from offload._planner.model_levers import (
    MODEL_LEVERS,
    TILED_LAYER_LEVERS,
    ModelLeverSet,
    check_head_model,
    check_model_levers,
    layer_levers_with,
    lever_candidates,
    not_candidates,
    pick_measured,
    ranked_variants,
    variants,
)
from offload._planner.search import compression
from offload._planner.settings import DEFAULT_PLANNER, PlannerSettings
from offload._planner.verify import equality, verified
from offload._recompute._reentrant import check_recompute
from offload.config import _check_int

__all__ = ["Plan", "plan"]


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
        compressed: with ``compress``, per layer whether an offloaded layer travels
            compressed (``False``: exactly). Default ``None``: every offloaded layer is
            compressed. :func:`plan` compresses only the layers where the cost model
            predicts it buys time.
        recompute: how ``"checkpoint"`` and ``"checkpoint_offload"`` recompute a layer:
            ``"non_reentrant"`` (default), torch's non-reentrant checkpoint; or
            ``"reentrant"``: the forward runs without a graph and again in the backward,
            which spares the host a hook per saved tensor but recomputes the layer's
            last operations too (``loss.backward()`` only: under ``torch.autograd.grad``
            the layers' parameters get no gradient, as under torch's reentrant
            checkpoint). :func:`plan` measures both and keeps the faster.
        model_levers: levers outside the layers' (:data:`MODEL_LEVERS`):
            ``"sliced_head"`` computes the causal LM's head and loss in slices
            (:func:`offload.sliced_head_loss` on ``head_model``), ``"tiled_mlp"`` runs
            each layer's ``mlp`` a tile of the sequence at a time
            (:func:`offload.tile_mlp`; with it, no selective lever). Default ``()``.
        head_model: the Hugging Face causal LM (``*ForCausalLM``) whose head
            ``"sliced_head"`` slices. Default ``None``.
        slice_tokens, tile_tokens: of ``sliced_head_loss`` and ``tile_mlp``. Default
            ``"auto"``.

    Raises:
        TypeError: ``levers`` is not a sequence of names.
        ValueError: wrong number of levers, an unknown lever, the last layer
            ``"offload"`` or ``"selective_offload"``, ``compressed`` of the wrong length
            or without ``compress``, ``recompute`` not one of ``RECOMPUTES``.

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
        compressed: Sequence[bool] | None = None,
        recompute: str = "non_reentrant",
        model_levers: Sequence[str] = (),
        head_model: torch.nn.Module | None = None,
        slice_tokens: int | str = "auto",
        tile_tokens: int | str = "auto",
    ) -> None:
        self.recompute = check_recompute(recompute)
        self.model_levers = check_model_levers(model_levers, "model_levers")
        check_head_model(self.model_levers, head_model)
        self.head_model = head_model
        self.slice_tokens = slice_tokens
        self.tile_tokens = tile_tokens
        self.layers = list(layers)
        self.levers = list(check_levers(levers, "levers"))
        if len(self.levers) != len(self.layers):
            raise ValueError(
                f"levers has {len(self.levers)} entries for {len(self.layers)} layers; give one "
                f"per layer"
            )
        if self.levers and self.levers[-1] in NOT_LAST:
            raise ValueError(
                f"levers: the last layer cannot be {self.levers[-1]!r} (its backward starts "
                f"as soon as its forward ends: nothing to hide the copy behind); use 'keep', "
                f"a recompute lever, or one that sends only the inputs "
                f"('checkpoint_offload', 'selective_offload_inputs')"
            )
        if "tiled_mlp" in self.model_levers:
            selective = [x for x in self.levers if x not in TILED_LAYER_LEVERS]
            if selective:
                raise ValueError(
                    f"levers {sorted(set(selective))} with model_levers 'tiled_mlp': the "
                    f"selective levers keep every tile's matrix products, all that tiling "
                    f"frees; use keep, offload, checkpoint or checkpoint_offload"
                )
        if compressed is not None:
            compressed = [bool(x) for x in compressed]
            if len(compressed) != len(self.layers):
                raise ValueError(
                    f"compressed has {len(compressed)} entries for {len(self.layers)} "
                    f"layers; give one per layer"
                )
            if compress is None:
                raise ValueError(
                    "compressed is set but compress=None: nothing is compressed; pass "
                    "compress='fp8', or drop compressed"
                )
        self.compressed = compressed
        self.costs = costs
        self.budget_bytes = budget_bytes
        self.compress = compress
        self.min_tensor_bytes = min_tensor_bytes
        self.measured = measured or {}
        self._wrappers: list[Recompute] = []
        self._offloader: Any = None
        self._handle: Any = None
        self._filter: CompressedLayers | None = None
        self._model_set: ModelLeverSet | None = None
        #: per set of model levers measured, its cost model (``()``: none), from which
        #: :meth:`replan` chooses; ``None`` for a plan made by hand
        self._variants: dict[tuple[str, ...], PlanCosts] | None = None
        #: per layer, what its selective recompute was seen to use (:class:`KeptKeys`), learnt
        #: by :func:`plan`'s measuring steps and handed to the selective wrappers of
        #: every plan made from them, so that their first step keeps no more than the
        #: next ones; ``None`` for a plan made by hand (its first step learns)
        self._learnt: list[KeptKeys] | None = None
        #: the tuning :func:`plan` measured with, which :meth:`replan` searches and
        #: verifies with unless given other settings
        self._settings: PlannerSettings = DEFAULT_PLANNER

    @property
    def _unlevered(self) -> PlanCosts | None:
        """The cost model without model levers (``costs`` where none was measured)."""
        return (self._variants or {}).get((), self.costs)

    @classmethod
    def from_levers(
        cls, layers: Sequence[torch.nn.Module], levers: Sequence[str], **kw: Any
    ) -> Plan:
        """A plan chosen by hand (same arguments as the constructor)."""
        return cls(layers, levers, **kw)

    # ---- predictions -----------------------------------------------------------------

    @property
    def predicted_seconds(self) -> float | None:
        return None if self.costs is None else self.costs.seconds(self.levers, self.compressed)

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
        settings: PlannerSettings | None = None,
    ) -> Plan:
        """A new plan for another ``budget`` from the same measured costs (same layers,
        levers allowed, ``compress`` and ``min_tensor_bytes``).

        Args:
            budget: bytes (``int``) or a fraction of the activation peak without levers
                (``float`` in ``(0, 1]``).
            step_fn: with ``model``, check the choice as :func:`plan` does: apply the
                fastest predicted plans in turn until one's measured peak fits, then
                measure the next few predicted almost as fast and the single-lever plans
                predicted to fit, and keep the fastest measured that fits (never slower
                than the best single lever). Default ``None``: the model's choice,
                unchecked (no step runs).
            model: the module whose forward runs the layers (with ``step_fn``).
            steps: measured steps per plan checked (after one warm-up). Default ``3``.
            settings: the search's and the verification's tuning
                (:class:`~offload._planner.settings.PlannerSettings`). Default ``None``:
                those this plan was measured with.

        Raises:
            RuntimeError: the plan has no costs (made by hand).
            ValueError: no plan meets the budget.
        """
        if self.costs is None:
            raise RuntimeError("this plan was made by hand: it has no costs to plan with")
        sets = self._variants or {self.costs.model_levers: self.costs}
        base = self._unlevered
        assert base is not None  # costs is not None
        limit = _budget_bytes(budget, base.memory(["keep"] * base.num_layers))
        allowed = self.measured.get("levers", LEVERS)
        tuning = self._settings if settings is None else settings
        if not isinstance(tuning, PlannerSettings):
            raise TypeError(f"settings={settings!r}: expected a PlannerSettings or None")

        def maker(c: PlanCosts) -> Callable[[list[str]], Plan]:
            def make(levers: list[str]) -> Plan:
                made = Plan(
                    self.layers,
                    levers,
                    costs=c,
                    budget_bytes=limit,
                    compress=self.compress,
                    min_tensor_bytes=self.min_tensor_bytes,
                    measured=dict(self.measured),
                    compressed=compression(c, levers, tuning) if self.compress else None,
                    recompute=self.recompute,
                    model_levers=c.model_levers,
                    head_model=self.head_model,
                    slice_tokens=self.slice_tokens,
                    tile_tokens=self.tile_tokens,
                )
                made._learnt = self._learnt
                made._variants = self._variants
                made._settings = tuning
                return made

            return make

        _check_int("steps", steps, minimum=1)
        try:
            order = ranked_variants(sets, limit, allowed, tuning)
        except ValueError as exc:
            raise ValueError(f"{exc}{not_candidates(self.measured)}") from None
        error: ValueError | None = None
        done: list[tuple[PlanCosts, list[str], list[dict[str, Any]]]] = []
        for c in order:  # the next set of model levers when none of one's plans fits
            try:
                levers, checks = verified(
                    c,
                    limit,
                    layer_levers_with(c.model_levers, allowed),
                    maker(c),
                    step_fn,
                    model,
                    steps,
                    tuning,
                )
            except ValueError as exc:
                error = error or exc
                continue
            done.append((c, levers, checks))
            # measured, the two sets ranked first compete (the model's time of a set is
            # anchored on its own step: a few percent off, as between plans)
            if step_fn is None or len(done) == 2:
                break
        if not done:
            assert error is not None
            raise error
        c, levers, checks = pick_measured(done, tuning)
        chosen = maker(c)(levers)
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
        return bool(self._wrappers) or self._offloader is not None or self._model_set is not None

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
            if self.model_levers:
                self._model_set = ModelLeverSet(
                    self.model_levers,
                    self.layers,
                    self.head_model,
                    slice_tokens=self.slice_tokens,
                    tile_tokens=self.tile_tokens,
                ).apply()
            offloaded = [i for i, lever in enumerate(self.levers) if lever in OFFLOADED]
            if offloaded:
                if self.compress is not None and self.compressed is not None:
                    chosen = [i for i, c in enumerate(self.compressed) if c]
                    self._filter = CompressedLayers(self.layers, chosen)
                self._offloader = ActivationOffloader(
                    self.layers,
                    offload_layers=offloaded,
                    compress=self.compress,
                    compress_filter=self._filter,
                    min_tensor_bytes=self.min_tensor_bytes,
                )
            for i, (layer, lever) in enumerate(zip(self.layers, self.levers)):
                if lever in RECOMPUTED:
                    kept = self._learnt[i] if self._learnt is not None else None
                    self._wrappers.append(
                        Recompute(layer, lever, self._offloader, kept, self.recompute)
                    )
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
        if self._filter is not None:
            self._filter.remove()
            self._filter = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._offloader is not None:
            self._offloader.close()
            self._offloader = None
        if self._model_set is not None:
            self._model_set.remove()
            self._model_set = None

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
            "compressed": self.compressed,
            "recompute": self.recompute,
            "model_levers": list(self.model_levers),
            "equality": equality(self.model_levers),
            "costs": None if self.costs is None else self.costs.to_dict(),
            "measured": self.measured,
            "errors": self.prediction_errors(),
        }

    def prediction_errors(self) -> list[dict[str, Any]]:
        """How far the cost model was from what :func:`plan` measured, one row per
        measured configuration: no lever (``"none"``) and each lever on every layer
        (``"all offload"``, ...; the predictions are anchored on the first, and the
        recompute levers' memory and time and, with ``compress``, the time of
        offloading are fitted to the others: ``"fitted"`` lists what was, whose error
        is about 0 by construction), then each plan the verification measured
        (``"plan"``, ``"rival"``, ``"corrected"``, ``"single <lever>"``). Each row: ``name``, ``levers``,
        predicted and
        measured seconds and bytes, and ``time_error``/``memory_error`` (predicted /
        measured - 1). Empty for a plan made by hand."""
        from offload._planner import report

        return report.prediction_errors(self)

    def table(self) -> Any:
        """A :class:`rich.table.Table`: one row per layer (lever, bytes kept between
        forward and backward, bytes sent each way, added backward ms) and a total row."""
        from offload._planner import report

        return report.plan_table(self)

    def summary(self) -> str:
        """Predicted time and peak against the step without levers and the budget."""
        from offload._planner import report

        return report.plan_summary(self)

    def report(self, console: Any = None) -> None:
        """Print the table, the measured configurations (when measured) and the summary
        with rich (``console``: a :class:`rich.console.Console`; default a new one on
        stdout)."""
        from offload._planner import report

        report.render_plan(self, console)

    def __repr__(self) -> str:
        extra = f"; {', '.join(self.model_levers)}" if self.model_levers else ""
        return f"Plan({summary(self.levers)}{extra})"


def _budget_bytes(budget: Any, activation_bytes: float) -> float:
    """``budget`` (bytes, or a fraction of ``activation_bytes``) in bytes; ``TypeError``
    or ``ValueError`` naming ``budget``."""
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


def _cuda_available() -> bool:
    """Whether :func:`plan` can measure (a seam for the CPU tests of its logic)."""
    return torch.cuda.is_available()


def _check_arguments(
    step_fn: Any, layers: Sequence[Any], budget: Any, model: Any, steps: Any, warmup: Any
) -> None:
    """The argument checks of :func:`plan`, before anything is measured."""
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable; got {type(step_fn).__name__}")
    if len(layers) < 1:
        raise ValueError("layers is empty")
    _budget_bytes(budget, 1.0)  # its type and range
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            "model must be the nn.Module whose forward calls the layers (the planner "
            "enters its measuring offloaders around that forward) or None (found by "
            f"running step_fn once); got {type(model).__name__}"
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
    warmup: int = 3,
    verify: bool = True,
    model_levers: Sequence[str] = MODEL_LEVERS,
    slice_tokens: int | str = "auto",
    tile_tokens: int | str = "auto",
    settings: PlannerSettings | None = None,
) -> Plan:
    """Measure ``step_fn`` and choose a lever per layer that meets ``budget`` at the
    least predicted step time.

    ``step_fn()`` runs one forward and backward of the model (no optimizer step, no
    offload context: the planner installs what it measures). It runs ``warmup + steps``
    times in each of these configurations, on the same model and state: nothing; an
    offloader with ``offload_layers="auto"`` (up to six steps: its warm measuring forward,
    after the first step of the process's coldest moments, gives each layer's forward
    and backward time and saved bytes, and the link bandwidth);
    every layer but the last offloaded; every layer selective; every layer checkpointed,
    once by each scheme of ``RECOMPUTES`` (the faster is the plan's ``recompute``; levers
    not allowed are skipped). Gradients accumulate across these steps.

    Args:
        step_fn: ``callable()``: forward and backward.
        layers: the repeated blocks, in call order, each called once per forward.
        budget: the activation peak allowed: bytes (``int``) or a fraction of the
            measured peak without levers (``float`` in ``(0, 1]``). "Activation peak":
            the most memory allocated during a step above what was allocated before it.
        model: the module whose forward runs ``layers`` (the measuring offloaders are
            entered around its forward). Default ``None``: found by running
            ``step_fn`` once (an extra warm-up step) as the outermost module whose
            forward is in progress at every layer call.
        levers: the levers the plan may use. Default: :data:`DEFAULT_LEVERS` (every
            lever of :data:`LEVERS`).
        compress: ``None`` (default) or ``"fp8"``: offloaded layers may travel
            compressed (lossy, see :class:`~offload.ActivationOffloader`); the plan
            compresses only the layers where the model predicts it buys time
            (:attr:`Plan.compressed`).
        min_tensor_bytes: of the offloader. Default ``256 * 1024``.
        steps: measured steps per configuration (>= 1). Default ``3``.
        warmup: unmeasured steps before them (>= 1: the first step of a fresh model
            allocates its gradients, which must not count as activations). Default ``3``:
            each configuration starts from an emptied allocator cache, and the first
            steps after it can run slower, which would make the configuration measured
            first, no lever, look slower than the levers measured against it.
        verify: apply the fastest predicted plan, measure ``steps`` steps (after a
            warm-up) and, when its peak exceeds the budget (the model errs by a few
            percent), plan again with room for the error seen and try that plan, up to
            ``verify_candidates`` plans; then measure up to ``verify_rivals`` plans
            predicted within ``verify_close`` of the one that fits, and every plan of a
            single lever predicted to fit (nothing, offloading all that hides,
            selective or full recompute of every layer, full recompute with offloaded
            inputs); measure those that fit again in ``verify_rounds`` alternating
            rounds and keep the fastest, never a plan slower than the best single lever
            (fields of ``settings``). Default ``True``.
        model_levers: levers outside the layers the plan may add: ``"sliced_head"``
            (:func:`offload.sliced_head_loss`; on a Hugging Face ``*ForCausalLM``
            holding ``layers``, a step passing ``labels``) and ``"tiled_mlp"``
            (:func:`offload.tile_mlp`; every layer has an ``mlp``). Each candidate set is
            measured and taken only where the budget needs it (no plan without it
            fits): gradients are then equal up to float summation order, not bitwise
            (Note [equality of the levers]).
            ``measured["model_levers"]`` says why one was not a candidate. Default:
            :data:`MODEL_LEVERS`; ``()``: none.
        slice_tokens, tile_tokens: of those levers. Default ``"auto"``.
        settings: the planner's tuning (a frozen
            :class:`~offload._planner.settings.PlannerSettings`). Default: its defaults.

    The activation peak is measured above what is allocated before each step, gradients
    included (they accumulate across the planner's steps). A loop that sets gradients
    to ``None`` before every step (``zero_grad(set_to_none=True)``) allocates them during
    the step, on top of the planned peak: leave room for them in the budget.

    Returns:
        A :class:`Plan`, not applied (call :meth:`Plan.apply`; :meth:`Plan.replan` gives
        the plan of another budget from the same measurement).

    Raises:
        TypeError: a wrong type (``step_fn`` not callable, ``budget`` not a number).
        ValueError: a bad value; ``model`` not given and not found (``step_fn`` calls
            the layers outside any module's forward); a budget no plan meets (the message
            gives the smallest that one does), or none of the plans tried measured
            within it.
        RuntimeError: no CUDA device (the planner measures device time and memory).

    Example::

        p = offload.plan(step, model.layers, budget=0.5)  # model: found by a step
        p.report()
        p.apply(model)      # then train as usual; p.remove() undoes it
    """
    tuning = DEFAULT_PLANNER if settings is None else settings
    if not isinstance(tuning, PlannerSettings):
        raise TypeError(f"settings={settings!r}: expected a PlannerSettings or None")
    allowed = check_levers(levers, "levers")
    wanted = check_model_levers(model_levers, "model_levers")
    layers = list(layers)
    _check_arguments(step_fn, layers, budget, model, steps, warmup)
    if model is None:
        model = find_model(step_fn, layers)
    causal, why_not = lever_candidates(model, layers, wanted)
    m = measure_configs(
        step_fn, layers, model, allowed, compress, min_tensor_bytes, steps, warmup, tuning
    )
    costs, fitted = fit_costs(m, compress)
    keys = [k for k in variants([x for x in wanted if not why_not[x]]) if k]
    got = measure_model_levers(
        step_fn, layers, model, causal, keys, m.saved_bytes, min_tensor_bytes, steps, warmup,
        slice_tokens=slice_tokens, tile_tokens=tile_tokens,
    )  # fmt: skip
    sets: dict[tuple[str, ...], PlanCosts] = {(): costs}
    for key, one in got.items():
        if "error" in one:
            for name in key:  # a lever alone failing says why; a pair only adds to it
                if len(key) == 1:
                    why_not[name] = one["error"]
            continue
        sets[key] = variant_costs(costs, key, one)
        m.configs["none + " + " + ".join(key)] = one["config"]
    measured = Plan(
        layers,
        ["keep"] * len(layers),
        costs=costs,
        compress=compress,
        min_tensor_bytes=min_tensor_bytes,
        measured={
            "configs": m.configs,
            "fitted": fitted,
            "levers": list(allowed),
            "model_levers": why_not,
        },
        recompute=m.recompute,
        head_model=causal,
        slice_tokens=slice_tokens,
        tile_tokens=tile_tokens,
    )
    measured._learnt = m.learnt
    measured._variants = sets
    measured._settings = tuning
    return measured.replan(budget, step_fn=step_fn if verify else None, model=model, steps=steps)
