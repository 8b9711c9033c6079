"""The planner's cost model: what a plan (one lever per layer) costs in activation
memory and step time, from a few figures measured on the user's own step.

The model is deliberately small so that every prediction can be explained:

* **Memory.** Layer ``i`` saves ``S_i`` bytes (what offloading it would move, measured
  by a forward with nothing offloaded). Between its forward and its backward it keeps
  ``resident_i``: ``S_i`` (keep), 0 (offload, selective_offload, checkpoint_offload,
  once released), ``rho_sel * S_i`` (selective), ``rho_ckpt * S_i`` (checkpoint),
  ``(rho_sel - rho_ckpt) * S_i`` (selective_offload_inputs: the kept outputs, its inputs
  gone); the offloaded ones hold what they send (``S_i``, ``rho_sel * S_i``,
  ``rho_ckpt * S_i``) until their release point and again once reloaded. The last layer's group,
  when offloaded, is released at its own close, before the head. During its forward a
  layer builds all ``S_i`` while the layers before it hold theirs (an offloaded group
  holds ``S_j`` until its release point, ``# Note [release order]``); during its
  backward it holds all ``S_i`` again (kept, reloaded or recomputed) while the layers
  below it hold their residents and the offloaded groups already reloaded for later (the
  reload points) hold ``S_j``. Each of those moments adds a workspace ``W``. Between the
  last layer's forward and its backward (the head, the loss and their gradients, which
  no lever touches) the layers hold their residents and the step adds ``H``. The
  predicted peak is the largest of these moments. ``W`` and ``H`` come from the step
  without levers: measured at each moment when :func:`offload.plan` could (``H`` known),
  else ``W`` is its peak minus the sum of ``S_i`` and counts at every moment.
  ``rho_sel`` and ``rho_ckpt`` are fitted to steps with each lever on every layer. Every
  prediction is anchored on the measured peak without levers.
* **Time.** Recompute adds to a layer's backward the measured extra time of its lever
  (the lever-on-every-layer step minus the plain step, shared out in proportion to the
  layers' forward times). Offloading follows ``offload/activations/_auto/_predict.py``'s replay of the copy
  schedule (one copy stream per direction, overlapping the compute beside it, the
  release and reload points of ``# Note [release order]``); with ``compress="fp8"`` each
  offloaded layer also costs a time fitted to the every-layer offload step (the codec's
  kernels and their waits, which the copy model does not see), and a layer offloaded
  exactly (``compressed`` false for it) sends ``S_i`` at no codec cost. Predictions are
  anchored on the measured step without levers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from offload._planner.levers import OFFLOADED, RECOMPUTE_KIND
from offload.activations._auto import _predict as _auto
from offload.activations._schedule import make_plan

__all__ = ["PlanCosts"]


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
        workspace_bytes: ``W``, memory a layer's forward or backward needs beyond the
            saved activations.
        head_bytes: ``H``, memory the step needs between the last layer's forward and
            its backward (head, loss, their gradients) beyond what the layers hold.
            Default ``None``: not measured; ``W`` then counts at every moment and that
            one is not modelled.
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
        model_levers: the model levers (``offload/_planner/model_levers.py``) these
            costs were measured with: every figure is that of the step with them
            applied. Default ``()``: none.

    Raises:
        ValueError: lists of different lengths, no layer, a negative number, or a
            fraction outside ``[0, 1]``.

    Example:
        >>> import offload
        >>> c = offload.PlanCosts(
        ...     forward_s=[1e-3] * 4, backward_s=[2e-3] * 4, saved_bytes=[2**28] * 4,
        ...     selective_kept=0.6, checkpoint_kept=0.05,
        ...     selective_s=[2e-4] * 4, checkpoint_s=[1e-3] * 4,
        ...     d2h_bps=50e9, h2d_bps=50e9)
        >>> c.memory(["checkpoint"] * 4) < c.memory(["keep"] * 4)
        True
        >>> round(c.seconds(["checkpoint"] * 4) / c.seconds(["keep"] * 4), 2)
        1.33
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
    head_bytes: int | None = None
    model_levers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_levers", tuple(self.model_levers))
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
        for name in ("workspace_bytes", "prefetch_bytes", "gap_s", "head_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
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

    def _layer_link(self, i: int, compressed: Sequence[bool] | None) -> int:
        """Bytes layer ``i`` sends when offloaded whole: ``link_bytes`` (compressed
        when the costs were measured with ``compress``), or ``S_i`` when ``compressed``
        says this layer travels exactly."""
        if compressed is not None and not compressed[i]:
            return self.saved_bytes[i]
        return self._link()[i]

    # ---- memory ----------------------------------------------------------------------

    def resident(self, i: int, lever: str) -> float:
        """Bytes layer ``i`` keeps between its forward and its backward under ``lever``."""
        s = self.saved_bytes[i]
        if lever == "keep":
            return s
        if lever == "selective_offload_inputs":  # the kept outputs; the inputs travel
            return max(0.0, self.selective_kept - self.checkpoint_kept) * s
        if lever in OFFLOADED:  # once released
            return 0.0
        if lever == "selective":
            return self.selective_kept * s
        return self.checkpoint_kept * s

    def share(self, lever: str) -> float:
        """The fraction of a layer's saved bytes that the offloader handles under
        ``lever``: all of them offloaded; what the recompute keeps (inputs included)
        under ``selective_offload`` (``rho_sel``) and ``checkpoint_offload``
        (``rho_ckpt``); the inputs alone under ``selective_offload_inputs``
        (``min(rho_ckpt, rho_sel)``: what a checkpoint keeps is the layer's inputs);
        else none."""
        if lever == "offload":
            return 1.0
        if lever == "selective_offload":
            return self.selective_kept
        if lever == "checkpoint_offload":
            return self.checkpoint_kept
        if lever == "selective_offload_inputs":
            return min(self.checkpoint_kept, self.selective_kept)
        return 0.0

    def sent(self, i: int, lever: str, compressed: Sequence[bool] | None = None) -> float:
        """Bytes layer ``i`` sends each way over the link under ``lever``."""
        return self.share(lever) * self._layer_link(i, compressed)

    def link_total(self, levers: Sequence[str], compressed: Sequence[bool] | None = None) -> float:
        """Bytes ``levers`` send each way over the link in one step."""
        return sum(self.sent(i, lever, compressed) for i, lever in enumerate(levers))

    def extra_seconds(self, i: int, lever: str) -> float:
        """Backward seconds that ``lever``'s recompute adds to layer ``i``."""
        kind = RECOMPUTE_KIND.get(lever)
        if kind == "selective":
            return self.selective_s[i]
        if kind == "checkpoint":
            return self.checkpoint_s[i]
        return 0.0

    def travels(self, i: int, lever: str) -> float:
        """Bytes of layer ``i`` that the offloader handles under ``lever`` (held on the
        device until the release point and again once reloaded): ``share(lever) * S_i``."""
        return self.share(lever) * self.saved_bytes[i]

    def raw_memory(self, levers: Sequence[str]) -> float:
        """The model's activation peak for ``levers`` (not anchored): the largest of
        every layer's forward, the head (when ``head_bytes`` is known) and every layer's
        backward (module docstring). O(L): an
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
        # the head: every group is released (the last one at its close), no reload has
        # started
        head = total + self.head_bytes if self.head_bytes is not None else total
        return max(peak, head)

    def memory(self, levers: Sequence[str]) -> float:
        """Predicted activation peak in bytes, anchored on the measured one."""
        return self._predicted(
            "memory", tuple(levers), lambda: self.raw_memory(levers), self.activation_bytes
        )

    def _predicted(
        self, kind: str, key: tuple[str, ...], raw: Callable[[], float], measured: float | None
    ) -> float:
        """``raw()`` (the prediction of the plan ``key``), anchored when ``measured``
        (the value without levers) is known: ``measured + raw() - raw of no levers``.
        Raw values are remembered per plan (at most :data:`_MEMO_LIMIT` per kind, then
        forgotten all at once)."""
        memo: dict[tuple[str, ...], float] = self._memos[kind]  # type: ignore[attr-defined]
        value = _remembered(memo, key, raw)
        if measured is None:
            return value
        keep = ("keep",) * self.num_layers
        fn = self.raw_memory if kind == "memory" else self.raw_seconds
        return measured + value - _remembered(memo, keep, lambda: fn(keep))

    # ---- time ------------------------------------------------------------------------

    def _layer_costs(
        self, levers: Sequence[str], compressed: Sequence[bool] | None = None
    ) -> list[_auto.LayerCost]:
        out = []
        for i, lever in enumerate(levers):
            fwd, bwd = self.forward_s[i], self.backward_s[i]
            share = self.share(lever)  # of the layer's link bytes that travel
            bwd += self.extra_seconds(i, lever)
            exact = compressed is not None and not compressed[i]
            if share and self.offload_s is not None and not exact:
                fwd += share * self.offload_s[i] / 2
                bwd += share * self.offload_s[i] / 2
            out.append(_auto.LayerCost(fwd, bwd, int(share * self._layer_link(i, compressed))))
        return out

    def raw_seconds(self, levers: Sequence[str], compressed: Sequence[bool] | None = None) -> float:
        """The model's step seconds for ``levers`` (not anchored); ``compressed``: per
        layer, whether an offloaded layer travels compressed (default ``None``: all of
        them, when the costs were measured with ``compress``)."""
        offloaded = [i for i, lever in enumerate(levers) if lever in OFFLOADED]
        costs = self._layer_costs(levers, compressed)
        return _auto.predict_step(costs, offloaded, self.d2h_bps, self.h2d_bps, None, self.gap_s)

    def seconds(self, levers: Sequence[str], compressed: Sequence[bool] | None = None) -> float:
        """Predicted step seconds, anchored on the measured step without levers
        (``compressed``: see :meth:`raw_seconds`)."""
        key = tuple(levers)
        if compressed is not None:
            key += tuple("fp8" if c else "exact" for c in compressed)
        return self._predicted(
            "seconds", key, lambda: self.raw_seconds(levers, compressed), self.step_s
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanCosts:
        return cls(**data)


#: Most raw predictions a :class:`PlanCosts` remembers per kind (then it forgets them
#: all).
_MEMO_LIMIT = 200_000


def _remembered(
    memo: dict[tuple[str, ...], float], key: tuple[str, ...], raw: Callable[[], float]
) -> float:
    """``raw()``, from ``memo[key]`` when it is there."""
    value = memo.get(key)
    if value is None:
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        value = memo[key] = raw()
    return value
