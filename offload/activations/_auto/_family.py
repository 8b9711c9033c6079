"""One kind of input under ``offload_layers="auto"`` (``offload/activations/_auto/_policy.py``): its
measured sizes, the scale real steps put on the measured costs, and the verification of
its choice against steps without offloading (:class:`Phase`).

A verification round measures steady state against steps without offloading: the
first ``warmup_steps`` steps of the choice after a measuring forward, and the first
``change_warmup_steps`` after a change of the choice, are not counted (the
offloader allocates pinned memory and reload buffers in them, and the allocator
settles); then steps without offloading alternate with steps
of the choice, each step of the choice paired with the step without offloading just
before it (drift of the device between distant steps cancels). The median of the
paired ratios is the measured ratio; the round decides after ``min_pairs`` pairs
when all agree, else after ``verify_steps``. The tolerance is ``1 + max_slowdown``
plus the measured noise (:meth:`Family.noise`: the spread of the steps without
offloading, at most ``max_slowdown``): above it one layer comes off (``backoff``) and
a round of the new choice follows; within it, the choice is settled (a choice the
prediction found free is not given up for a difference the noise explains) and the
median ratio of its last ``watch_steps`` timed steps is watched against the same
tolerance: past it, a fresh round (new steps without offloading) starts. A choice
memory forces is never backed off.

The step up: the prediction for one more layer is on the safe side (a few percent of
error in the link's rate or a layer's time moves that layer's stall by as much as the
whole limit), so a choice measured within ``1 + max_slowdown`` itself (not only within
the noise) whose next layer is predicted within ``1 + step_up_reach * max_slowdown``
takes that layer (``backoff`` goes negative) and verifies it in a round of its own,
against ``1 + max_slowdown`` without the noise (the prediction did not find that layer
free, so the noise's doubt does not count for it); above, the layer comes off again as
any back-off does, and no step up is tried again for this kind of input (nor after any
back-off). A step up kept is verified like any choice, so where the layer after it is
again predicted within reach, it steps up again. A step up is one layer beyond the
choice it was measured from: where the scale moves the prediction's choice, it is
dropped. Only a round whose steps all ran at one size steps up: where sizes change, the
ratios carry the prediction's error between sizes, and a trial that fails runs its
steps above the limit.

The scale: a timed step whose measured/predicted ratio the prediction can explain (a
size measured, one within ``extrapolation`` of those measured,
or one whose ratio is within ``prediction_tolerance`` of the scale) moves the scale
(the lower quartile of the ratios, kept per kind of step; steps without offloading
first, as they hold no stall), which multiplies every predicted compute time; a move of
more than ``rescale`` re-decides, and starts the round again only where the choice
changes. A step at another size whose ratio is further off means the prediction was
wrong there: the next step measures again. When the measured sizes change, the scale is
taken again from the steps without offloading kept (:meth:`Family.rescale`).

Note [stale predictions]
~~~~~~~~~~~~~~~~~~~~~~~~
A step's time is read when its marks complete, which on a device-paced model can be
steps after it started: the host runs ahead, and a measuring forward read in between
(it waits for its own marks) may have replaced the points the step's prediction came
from. Such a step is read against the points it ran under no longer: a step without
offloading against what the current points predict at its size (what
:meth:`Family.rescale` does for those already read), any other step against nothing
(its sample still counts for the verification, which compares measured times only).
The first step's points carry its one-time costs, many times the warm ones: a step
read against them would scale the warm costs down by as much, every compute time would
look that much shorter, no copy would look hidden, and ``offload.plan``, which reads
its layer costs from here, would plan on them.

The tuning named in lower case (``verify_steps``, ...) is a field of
:class:`~offload.activations._auto._settings.AutoSettings`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import statistics
from typing import Any

from offload.activations._auto import _predict as _auto
from offload.activations._auto._fit import Estimate, ShapeModel
from offload.activations._auto._probe import DeviceMemory, StepWatch
from offload.activations._auto._settings import DEFAULT_AUTO, AutoSettings

__all__ = [
    "Family",
    "Memory",
    "Phase",
    "Run",
    "Sized",
    "StepRecord",
    "base_seconds",
]


class Phase(enum.Enum):
    """Where one kind of input stands (module docstring)."""

    MEASURE = "measure"
    VERIFY = "verify"
    SETTLED = "settled"


class Run(enum.Enum):
    """What one step runs: a measuring forward, the choice, or nothing offloaded."""

    PROBE = "probe"
    PLAN = "plan"
    NONE = "none"


@dataclasses.dataclass
class Memory:
    """The memory side of one decision, in bytes: the limit less the margin,
    the predicted peak with ``"all"`` and with the choice, whether a step without
    offloading fits, the fewest layers memory needs, and the predicted peak of a step
    without offloading."""

    limit: float
    peak_all: float
    peak: float
    none_fits: bool
    floor: int
    none_peak: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Sized:
    """What one size needs per step, kept while the model's points do not change: its
    costs, the device bytes calls ``k..L-2`` keep resident (``kept[k]``), the unscaled
    predicted step time per number of offloaded layers, and the last decision with
    what it depended on (``stamp``) and its JSON-ready form."""

    version: int
    est: Estimate
    kept: list[float]
    predicted: dict[int, float] = dataclasses.field(default_factory=dict)
    stamp: Any = None
    decision: _auto.AutoDecision | None = None
    stats: dict[str, Any] | None = None


@dataclasses.dataclass
class StepRecord:
    """One step, from its start until its time is read."""

    family: Family
    tokens: int
    quad: int
    run: Run
    offloaded: int
    forced: bool
    exact: bool
    generation: int
    predicted_s: float | None  # unscaled prediction of the step's time
    predicted_peak: float | None
    start_memory: DeviceMemory | None
    cold: bool = False
    #: the choice's predicted ratio with one more layer (``None``: no layer more)
    next_ratio: float | None = None
    #: the points ``predicted_s`` came from: ``(model, model.version)`` (Note [stale
    #: predictions])
    points: tuple[Any, int] | None = None
    tick: int = 0  # the family's step count when it was prepared
    #: calls run recomputed, their inputs offloaded (Note [recomputed calls])
    recomputed: tuple[int, ...] = ()
    warmup: bool = False  # a step of the choice not counted (module docstring)
    watch: StepWatch | None = None
    age: int = 0


class Family:
    """One kind of input: its measured sizes, scale, verification state and back-off."""

    def __init__(self, settings: AutoSettings = DEFAULT_AUTO) -> None:
        self.settings = settings
        self.model: ShapeModel | None = None
        self.phase = Phase.MEASURE
        self.scale = 1.0
        self.residuals: dict[Run, collections.deque[float]] = {
            Run.NONE: collections.deque(maxlen=settings.residuals),
            Run.PLAN: collections.deque(maxlen=settings.residuals),
        }
        self.generation = 0
        #: layers taken off the prediction's choice (negative: added by a step up)
        self.backoff = 0
        self.step_up = True  # no back-off yet: a step up may be tried
        #: steps without offloading: (tokens, quad, seconds); in flight: not read yet
        self.none: collections.deque[tuple[int, int, float]] = collections.deque(
            maxlen=settings.verify_steps
        )
        self.none_in_flight = 0
        #: steps of the choice this generation: (tokens, quad, seconds, forced, ratio to
        #: the step without offloading just before it, or None when unpaired)
        self.plan: collections.deque[tuple[int, int, float, bool, float | None]] = (
            collections.deque(maxlen=settings.watch_steps)
        )
        #: the last step without offloading read: (tick, tokens, quad, seconds)
        self.last_none: tuple[int, int, int, float] | None = None
        self.warmup = 0  # steps of the choice still to skip
        self.round_none = 0  # steps without offloading run in this round
        self.last_run: Run | None = None
        self.tick = 0  # steps prepared
        self.reprobe = False
        #: the only measurement is the offloader's first step: the next step runs
        #: without offloading where memory allows, and its time scales those costs
        self.calibrate = False
        self.probing = False
        self.measured_ratio: float | None = None
        self.memory_excess = 0.0
        self.blocked = 0
        self.note = ""
        self.sizes: collections.OrderedDict[tuple[int, int], Sized] = collections.OrderedDict()

    def learn_memory(self, start: DeviceMemory, end: DeviceMemory, predicted: float) -> None:
        """What a step needed beyond its predicted peak (a measuring step: its own
        allocated peak), kept for the decisions after it: the allocated peak's excess,
        and the reserved peak's (the per-process cap limits reserved memory, so the
        unused parts of the allocator's segments at the peak count against it). Each
        only when the step set a new peak of its kind."""
        if end.peak > start.peak:
            self.memory_excess = max(self.memory_excess, end.peak - predicted)
        if (
            end.reserved_peak is not None
            and start.reserved_peak is not None
            and end.reserved_peak > start.reserved_peak
        ):
            self.memory_excess = max(self.memory_excess, end.reserved_peak - predicted)

    def new_generation(self, note: str = "") -> None:
        """The choice changed (back-off, scale): its samples start again, and a settled
        choice is verified again (the steps without offloading are kept)."""
        self.generation += 1
        self.plan.clear()
        self.warmup = max(self.warmup, self.settings.change_warmup_steps)
        self.round_none = 0
        if self.phase is Phase.SETTLED:
            self.phase = Phase.VERIFY
        if note:
            self.note = note

    def rescale(self) -> None:
        """The measured sizes changed: the scale again from the steps without
        offloading kept (their times over the new prediction; a step of the choice
        measured against the old prediction says nothing about the new one)."""
        self.residuals[Run.PLAN].clear()
        ratios = self.residuals[Run.NONE]
        ratios.clear()
        for n, q, t in self.none:
            p = self.base(n, q)
            if p > 0:
                ratios.append(t / p)
        self.scale = _low(ratios) if ratios else 1.0

    def settle(self, note: str) -> None:
        self.phase = Phase.SETTLED
        self.note = note

    def none_at(self, tokens: int, quad: int) -> float | None:
        """The step time without offloading at a size: the measured ones, carried to it
        by the prediction's ratio between sizes."""
        if not self.none or self.model is None:
            return None
        ratios = []
        for n, q, t in self.none:
            p = self.base(n, q)
            if p > 0:
                ratios.append(t / p)
        if not ratios:
            return None
        return self.base(tokens, quad) * statistics.median(ratios)

    def sized(self, tokens: int, quad: int) -> Sized:
        """The costs at one size (cached per size while the points do not change, the
        ``max_decisions`` sizes used last)."""
        model = self.model
        sized = self.sizes.get((tokens, quad))
        if sized is None or sized.version != model.version:  # type: ignore[union-attr]
            est = model.predict(tokens, quad)  # type: ignore[union-attr]
            L = len(est.freed)
            kept = [0.0] * L
            for k in range(L - 2, -1, -1):
                kept[k] = kept[k + 1] + est.freed[k]
            sized = self.sizes[(tokens, quad)] = Sized(model.version, est, kept)  # type: ignore[union-attr]
            while len(self.sizes) > self.settings.max_decisions:
                self.sizes.popitem(last=False)
        self.sizes.move_to_end((tokens, quad))
        return sized

    def base(self, tokens: int, quad: int) -> float:
        """The unscaled predicted step time without offloading at a size (kept with the
        size's costs: the samples of every verification ask for theirs at each read)."""
        sized = self.sized(tokens, quad)
        got = sized.predicted.get(0)
        if got is None:
            got = sized.predicted[0] = base_seconds(sized.est)
        return got

    def ratio(self, samples: list[tuple[int, int, float, bool, float | None]]) -> list[float]:
        """Each sample's ratio: paired, else against the steps without offloading
        carried to its size."""
        out = []
        for n, q, t, _, paired in samples:
            if paired is not None:
                out.append(paired)
                continue
            none = self.none_at(n, q)
            if none:
                out.append(t / none)
        return out

    def normalized(self, tokens: int, quad: int, seconds: float) -> float | None:
        """A step's time over the predicted time without offloading at its size."""
        p = self.base(tokens, quad)
        return seconds / p if p > 0 else None

    def noise(self, max_slowdown: float) -> float:
        """Half the relative spread of the steps without offloading (carried to one
        size), at most ``max_slowdown``: a ratio within it of the limit is noise."""
        values = [v for n, q, t in self.none if (v := self.normalized(n, q, t)) is not None]
        if len(values) < 2:
            return 0.0
        mid = statistics.median(values)
        return min(max_slowdown, (max(values) - min(values)) / (2 * mid)) if mid > 0 else 0.0

    def evaluate(self, max_slowdown: float, next_ratio: float | None = None) -> None:
        """After a step's time was read: finish a verification round (``next_ratio``:
        the choice's predicted ratio with one more layer, for a step up) or watch."""
        limit = 1.0 + max_slowdown
        samples = list(self.plan)
        if self.phase is Phase.VERIFY:
            if len(self.none) < self.settings.min_pairs:
                return
            ratios = self.ratio(samples[-self.settings.verify_steps :])
            if len(ratios) < self.settings.min_pairs:
                return
            # a step up is taken on a measurement within the limit itself (the
            # prediction did not find it free: no benefit of the noise's doubt)
            tol = limit if self.backoff < 0 else limit + self.noise(max_slowdown)
            m = statistics.median(ratios)
            self.measured_ratio = m
            if len(ratios) < self.settings.verify_steps:
                if all(r > tol for r in ratios):
                    m = min(ratios)
                elif not all(r <= tol for r in ratios):
                    return  # not unanimous: more pairs
            if m > tol and not all(s[3] for s in samples):
                self.backoff += 1
                self.step_up = False
                self.new_generation(
                    f"measured {m:.3f}x against steps without offloading: one layer less"
                )
            elif m > tol:
                self.settle(f"measured {m:.3f}x; memory allows no fewer layers")
            elif self._steps_up(m, max_slowdown, next_ratio, samples):
                self.backoff -= 1
                self.new_generation(
                    f"verified: {m:.3f}x against steps without offloading; one layer more "
                    f"(predicted {next_ratio:.3f}x, a prediction on the safe side), "
                    f"measured next"
                )
            else:
                self.settle(f"verified: {m:.3f}x against steps without offloading")
        elif (
            self.phase is Phase.SETTLED and len(samples) >= self.settings.watch_steps and self.none
        ):
            ratios = self.ratio(samples)
            measured = statistics.median(ratios) if ratios else None
            self.measured_ratio = measured
            tol = limit + self.noise(max_slowdown)
            if measured is not None and measured > tol and not all(s[3] for s in samples):
                self.phase = Phase.VERIFY
                self.none.clear()
                self.plan.clear()
                self.last_none = None
                self.round_none = 0
                self.note = f"the measured ratio drifted to {measured:.3f}x: verifying again"

    def observe(
        self,
        record: StepRecord,
        seconds: float,
        end: DeviceMemory | None,
        max_slowdown: float,
    ) -> None:
        """A timed step of this kind completed: memory, scale, prediction check,
        verification."""
        run = record.run
        if run is Run.NONE:
            self.none_in_flight = max(0, self.none_in_flight - 1)
        start = record.start_memory
        if start is not None and end is not None and record.predicted_peak is not None:
            self.learn_memory(start, end, record.predicted_peak)
        if self.model is None or not record.predicted_s or record.warmup:
            return
        predicted, exact = self._prediction(record)
        if run is Run.NONE:
            self.calibrate = False
        if predicted is None:
            pass  # a prediction from points since replaced says nothing about these
        elif (
            exact
            or self.model.within(record.tokens)
            or abs(seconds / predicted / self.scale - 1.0) <= self.settings.prediction_tolerance
        ):
            rho = seconds / predicted
            # what the step took beyond the prediction is the instrumentation's share
            # (and the first step's), at every size the prediction holds
            self.residuals[run].append(rho)
            scale = _low(self.residuals[Run.NONE] or self.residuals[Run.PLAN])
            if abs(scale / self.scale - 1.0) > self.settings.rescale:
                # re-decided at the next step; the round starts again only where that
                # changes the choice (AutoPolicy._decide): where step times jitter the
                # scale moves often, and a restart at every move could leave a round
                # that never ends while an unverified choice runs
                self.scale = scale
        else:
            self.reprobe = True  # the prediction for this size proved wrong
        if run is Run.NONE:
            self.none.append((record.tokens, record.quad, seconds))
            self.last_none = (record.tick, record.tokens, record.quad, seconds)
        elif record.generation == self.generation:
            self.plan.append(
                (record.tokens, record.quad, seconds, record.forced, self._paired(record, seconds))
            )
        current = record.generation == self.generation
        self.evaluate(max_slowdown, record.next_ratio if current else None)

    def _steps_up(
        self,
        m: float,
        max_slowdown: float,
        next_ratio: float | None,
        samples: list[tuple[int, int, float, bool, float | None]],
    ) -> bool:
        """Whether a verified choice takes one more layer (module docstring: the step
        up): measured within the limit itself, at one size, its next layer predicted
        within reach, no back-off measured before (every back-off clears ``step_up``),
        and the choice the link's, not memory's."""
        return (
            self.step_up
            and m <= 1.0 + max_slowdown
            and next_ratio is not None
            and next_ratio <= 1.0 + self.settings.step_up_reach * max_slowdown
            and not any(s[3] for s in samples)
            and len({(s[0], s[1]) for s in samples} | {(n, q) for n, q, _ in self.none}) == 1
        )

    def _prediction(self, record: StepRecord) -> tuple[float | None, bool]:
        """The unscaled prediction a timed step is read against, and whether it is a
        measured size's own (Note [stale predictions]): the step's own, made when it
        started; where the points changed since, a step without offloading is read
        against what the current points predict at its size, any other step against
        nothing (``None``)."""
        points = record.points
        if points is None or (points[0] is self.model and points[1] == points[0].version):  # type: ignore[union-attr]
            return record.predicted_s, record.exact
        if record.run is not Run.NONE:
            return None, False
        exact = self.sized(record.tokens, record.quad).est.exact
        return self.base(record.tokens, record.quad), exact

    def _paired(self, record: StepRecord, seconds: float) -> float | None:
        """A step of the choice over the step without offloading just before it (both
        carried to one size), or ``None``."""
        last = self.last_none
        if last is None or last[0] != record.tick - 1:
            return None
        mine = self.normalized(record.tokens, record.quad, seconds)
        theirs = self.normalized(last[1], last[2], last[3])
        return mine / theirs if mine is not None and theirs else None


def _low(values: Any) -> float:
    """The lower quartile: what a step takes beyond its prediction is noise both ways,
    plus one-time costs one way only (a garbage collection, a first allocation);
    reading the scale low keeps them from making compute look longer than it is (which
    would hide copies that stall)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def base_seconds(est: Estimate) -> float:
    """The predicted seconds of a step without offloading."""
    return sum(c.forward(False) + c.backward(False) for c in est.costs) + est.gap_s
