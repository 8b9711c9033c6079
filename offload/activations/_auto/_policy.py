"""The policy of ``offload_layers="auto"``: measure, decide, verify, re-decide.

Per kind of input (a :class:`Family`, ``offload/activations/_auto/_family.py``: the first layer
call's tensor ranks, dtypes and devices, and the hidden size; sizes may change within
one) the policy moves through :class:`Phase`:

``MEASURE``
    Nothing measured yet. The step runs ``"all"`` (every call but the last offloaded:
    never more device memory than ``"all"``) as a measuring forward
    (``offload/activations/_auto/_probe.py``).
``VERIFY``
    Decided. Each step's plan is the longest prefix the link hides (``offload/activations/_auto/_predict.py``)
    from the costs at its size (measured, or predicted by ``offload/activations/_auto/_fit.py``),
    scaled by what real steps measured against the prediction (the measuring forward's
    instrumentation, and the process's first step, cost time a real step does not
    spend), and never fewer layers than the device memory needs
    (:func:`offload.activations._auto._predict.memory_floor`; the memory reason is recorded). After the
    choice's warm-up steps, steps without offloading alternate with the chosen ones
    while memory allows them (``offload/activations/_auto/_family.py``: paired ratios, their median,
    the measured noise); when the measured ratio exceeds ``1 + max_slowdown`` by more
    than the noise, one layer comes off and the round repeats; a choice measured within
    the limit whose next layer is predicted within ``step_up_reach`` times it takes
    that layer and verifies it (``offload/activations/_auto/_family.py``: the step up).
``SETTLED``
    Verified, or forced by memory, or unverifiable (memory never allows a step without
    offloading). One step in ``watch_every`` is timed and the ratio watched; past the
    limit, a fresh round of ``VERIFY`` starts.

The first measurement of an offloader is its first step (the allocator and the kernels
warm up in it): the next step measures again at its own plan. A size predicted, not
measured, whose step proves the prediction wrong is measured again at the next step.
State is bounded: ``max_families`` kinds of input, ``max_points``
sizes each, ``max_decisions`` sizes' decisions, ``max_pending`` steps whose times
are not read yet, bounded sample queues.

The tuning named in lower case (``watch_every``, ...) is a field of
:class:`~offload.activations._auto._settings.AutoSettings`.
"""

from __future__ import annotations

import collections
import functools
import sys
from typing import Any

import torch

from offload.activations._auto import _predict as _auto
from offload.activations._auto._family import (
    Family,
    Memory,
    Phase,
    Run,
    Sized,
    StepRecord,
)
from offload.activations._auto._fit import (
    Estimate,
    Point,
    ShapeModel,
    point_values,
    steady,
    warm_up,
)
from offload.activations._auto._probe import (
    DeviceMemory,
    Meter,
    Probe,
    ProbeResult,
    StepWatch,
    meter_for,
)
from offload.activations._auto._settings import DEFAULT_AUTO, AutoSettings
from offload.activations._auto._short import check_short
from offload.activations._auto._steps import describe, predicted, step_stats
from offload.activations._schedule import plan_forward

__all__ = [
    "AutoPolicy",
    "Family",
    "Phase",
    "Run",
]


#: said once per offloader, on its first measuring step on an accelerator
_FIRST_STEP = (
    "offload: the first step measures every layer with its copies in flight and pins "
    "host memory as it goes (one-time work: it can take several times a later step)"
)

_NO_ACCELERATOR = {
    "reason": "no accelerator: there is no overlap to measure and no device memory to "
    "save; 'auto' selects like 'all' (every call but the last)"
}


def _predicted_bytes(m: ProbeResult, est: Estimate) -> None:
    """A measurement without counts: the bytes of its calls not offloaded from the
    prediction at its size (they scale with the tokens, as the fit models them)."""
    for i, offloaded in enumerate(m.offloaded):
        if not offloaded:
            c = est.costs[i]
            m.link_bytes[i], m.freed_bytes[i], m.copies[i] = c.nbytes, int(est.freed[i]), c.copies


def _roomy(mem: Memory | None, room: float) -> bool:
    """Whether a step without offloading is predicted far inside the memory limit
    (within ``room`` of it: ``calibrate_room``)."""
    return mem is None or (mem.floor == 0 and mem.none_peak <= room * mem.limit)


def _scaled(est: Estimate, s: float) -> tuple[list[_auto.LayerCost], float]:
    costs = [  # the constructor, not dataclasses.replace: once per layer and new size
        _auto.LayerCost(
            c.forward_s * s,
            c.backward_s * s,
            c.nbytes,
            c.host_forward_s * s,
            c.host_backward_s * s,
            c.copies,
        )
        for c in est.costs
    ]
    return costs, est.gap_s * s


def _recompute_split(
    off: Any,
    sized: Sized,
    decision: _auto.AutoDecision,
    prefetch: int | None,
    cold: bool = False,
    mem: Memory | None = None,
    device_limit: float | None = None,
    settings: AutoSettings = DEFAULT_AUTO,
) -> tuple[int, tuple[int, ...]]:
    """The offloaded prefix and the calls run recomputed, their inputs offloaded
    (Note [recomputed calls]), where memory forces more offloading than the link
    hides or the host budget holds: offloading the memory floor's prefix (host
    permitting), or the prefix the link hides (within the host budget) with every
    later call recomputed, whichever is predicted faster. Otherwise the choice as
    it is, and nothing recomputed. A peak past the memory limit even so (what remains
    is outside the layers) raises ``ActivationMemoryError`` where it is measured, else
    is said once (Note [memory short]; ``device_limit``: the device's own limit)."""
    costs = sized.est.costs
    L, k = len(costs), len(decision.offloaded)
    room = off._runtime.pool.limit * (1.0 - settings.memory_margin)
    host_k, total = 0, 0
    for c in costs:
        total += c.nbytes
        if total > room:
            break
        host_k += 1
    if decision.memory_reason is None:  # memory needs no more than the link hides
        if k <= host_k:
            return k, ()
        if decision.memory_offloaded <= host_k:
            # the host holds fewer calls than the link hides, and memory (its floor)
            # still fits with the rest resident
            return host_k, ()
    d2h, h2d = decision.d2h_gbps * 1e9, decision.h2d_gbps * 1e9
    inf = float("inf")
    per_copy = settings.host_seconds_per_copy
    offload_all = predicted(sized, k, d2h, h2d, prefetch, per_copy) if k <= host_k else inf
    kb = min(decision.time_offloaded, host_k, L - 1)
    if cold:
        # costs from the first step only, whose one-time work makes copies look
        # hidden: one layer offloaded until warm steps rescale them (as prepare's
        # re-probe does where memory has room)
        kb = min(kb, 1)
    with_recompute = predicted(sized, kb, d2h, h2d, prefetch, per_copy) + sum(
        c.forward_s for c in costs[kb:]
    )
    if mem is not None and mem.peak_all > mem.limit:
        act = sized.est.act_bytes or 0.0
        check_short(
            off,
            off._layers,
            sized.est.exact,
            mem.peak_all,
            device_limit if device_limit is not None else float("inf"),
            mem.peak_all - act,
            f"device memory: the step's predicted peak, {mem.peak_all / 2**30:.2f} GiB, "
            f"exceeds {mem.limit / 2**30:.2f} GiB (the limit less {settings.memory_margin:.0%}) "
            f"even with every layer call offloaded or recomputed: what remains is "
            "outside the layers (the head and the loss, the weights and their "
            "gradients). Compute the head and the loss in slices "
            "(offload.sliced_head_loss(model)), tile the MLPs (offload.tile_mlp) or "
            "offload weights (offload.WeightOffloader) to fit.",
        )
    if offload_all <= with_recompute:
        return k, ()
    return kb, tuple(range(kb, L))


class AutoPolicy:
    """``offload_layers="auto"`` for one offloader (module docstring).

    ``meter``: how it measures (``None``: CUDA events and the caching allocator on a
    CUDA device, nothing elsewhere); set through ``Internals.use_meter``: ``Meter()``,
    the host clock on the CPU path, or a test's scripted meter."""

    def __init__(self, settings: AutoSettings | None = None) -> None:
        if settings is not None and not isinstance(settings, AutoSettings):
            raise TypeError(f"settings={settings!r}: expected an AutoSettings or None")
        #: the tuning, chosen once (:class:`AutoSettings`; ``None``: its defaults)
        self.settings = DEFAULT_AUTO if settings is None else settings
        self.families: collections.OrderedDict[Any, Family] = collections.OrderedDict()
        self.pending: collections.deque[StepRecord] = collections.deque()
        self.meter: Meter | None = None
        self._cold = True  # no step of this offloader measured yet

    def state_size(self) -> dict[str, int]:
        """How much the policy remembers (bounded: module docstring)."""
        fams = list(self.families.values())
        return {
            "families": len(fams),
            "points": sum(len(f.model.points) for f in fams if f.model is not None),
            "decisions": sum(len(f.sizes) for f in fams),
            "pending": len(self.pending),
            "samples": sum(len(f.none) + len(f.plan) for f in fams),
        }

    # ---- one step ----------------------------------------------------------------------

    def prepare(self, off: Any, step: Any, inputs: Any) -> None:
        """Before the first layer call of ``step``: give it its plan and its watch."""
        described = describe(inputs)
        if described is None:
            step.stats.auto = dict(_NO_ACCELERATOR)
            return
        key, tokens, quad, device = described
        meter = self.meter if self.meter is not None else meter_for(device)
        if meter is None:
            step.stats.auto = dict(_NO_ACCELERATOR)
            return
        cfg = off.config
        if not step.capture:  # a capture allows no event queries (nor waits)
            self._collect(cfg.max_slowdown)
        fam = self.families.get(key)
        if fam is None:
            fam = self.families[key] = Family(self.settings)
            while len(self.families) > self.settings.max_families:
                self.families.popitem(last=False)
        self.families.move_to_end(key)
        memory = None if step.capture else meter.memory(device)
        if fam.model is None:
            self._measure_all(off, step, fam, meter, device, tokens, quad, memory)
            return
        sized = fam.sized(tokens, quad)
        est = sized.est
        decision, mem, stats = self._decide(fam, sized, memory, meter, device, cfg)
        chosen = len(decision.offloaded)
        if step.capture:  # a captured step is neither timed nor verified
            run = Run.PLAN if chosen else Run.NONE
        else:
            run = self._next_run(fam, decision, mem)
        k = 0 if run is Run.NONE else chosen
        # measured again at the step's own plan (never a verifying step's)
        probe = not step.capture and fam.reprobe and not fam.probing and k == chosen
        if (
            probe
            and _roomy(mem, self.settings.calibrate_room)
            and all(p.cold for p in fam.model.points)
        ):
            # the choice comes from the first step's costs, which its one-time work
            # inflates (copies look hidden): measured warm with one layer offloaded,
            # where memory leaves room (the cold step's memory reading is the least sure)
            k = min(k, 1)
        L = fam.model.num_groups
        calls = off._calls if len(off._calls) == L else [None] * L
        recomputed: tuple[int, ...] = ()
        if k and k == chosen and not step.capture:
            cold = all(p.cold for p in fam.model.points)
            limit = None if memory is None else float(memory.limit)
            k, recomputed = _recompute_split(
                off, sized, decision, cfg.prefetch_layers, cold, mem, limit, self.settings
            )
            # a recomputed call measures its recompute, not its saves: not a probe
            probe = probe and not recomputed
        off._first_recomputed = 0 in recomputed
        step.plan = plan_forward(tuple(range(k)), calls, cfg.prefetch_layers, recomputed)
        fam.last_run = run
        # settled: every watch_every-th step is timed (the watch's own cost)
        fam.tick += 1
        watched = not step.capture and (
            probe or fam.phase is not Phase.SETTLED or fam.tick % self.settings.watch_every == 0
        )
        warmup = False
        if probe:
            fam.reprobe = False
        elif run is Run.NONE and watched:
            fam.none_in_flight += 1
            if fam.phase is Phase.VERIFY:
                fam.round_none += 1
        elif run is Run.PLAN and watched and fam.warmup > 0:
            fam.warmup -= 1
            warmup = True
        d2h, h2d = decision.d2h_gbps * 1e9, decision.h2d_gbps * 1e9
        record = StepRecord(
            family=fam,
            tokens=tokens,
            quad=quad,
            run=Run.PROBE if probe else run,
            offloaded=k,
            forced=decision.memory_reason is not None,
            exact=est.exact,
            generation=fam.generation,
            predicted_s=predicted(
                sized, k, d2h, h2d, cfg.prefetch_layers, self.settings.host_seconds_per_copy
            )
            + sum(est.costs[i].forward_s for i in recomputed),
            next_ratio=decision.next_ratio,
            predicted_peak=None
            if mem is None
            else mem.peak_all + (0 if recomputed else sized.kept[k]),
            start_memory=memory,
            tick=fam.tick,
            warmup=warmup,
            recomputed=recomputed,
            points=(fam.model, sized.version),
        )
        if watched:
            # the step's peak is read at its end where memory binds (the model's error)
            tight = mem is not None and (mem.floor > 0 or mem.peak > 0.8 * mem.limit)
            self._watch(off, step, record, meter, device, probe, tight)
        out = dict(stats)
        out.update(step_stats(fam, record, decision, est, mem, self.state_size()))
        if recomputed:
            out["recomputed"] = list(recomputed)
            out["reason"] = (
                f"memory: {len(recomputed)} of {L} layer calls recomputed (inputs "
                f"offloaded), the first {k} offloaded: more offloading than the link hides "
                "or the host holds would cost more than recomputing. " + str(out.get("reason", ""))
            )
        step.stats.auto = out

    def _measure_all(
        self,
        off: Any,
        step: Any,
        fam: Family,
        meter: Meter,
        device: torch.device,
        tokens: int,
        quad: int,
        memory: DeviceMemory | None,
    ) -> None:
        """Nothing measured for this kind of input: offload like ``"all"``, measuring
        (unless a measuring forward is still waiting for its backward)."""
        step.plan = plan_forward("all", off._calls, off.config.prefetch_layers)
        offloaded = sorted(step.plan.offloaded)
        if fam.probing:
            step.stats.auto = {
                "phase": fam.phase.value,
                "step": Run.PLAN.value,
                "offloaded": offloaded,
                "reason": "waiting for the measuring forward's backward: offloading like "
                "'all' (every call but the last) until then",
                "state": self.state_size(),
            }
            return
        # the link is probed and the fit warmed now, in the step that pays one-time
        # costs anyway (pinned memory, kernel selection), not in the first decision's
        # step (the link's figures are cached per device; a capture allows no probe)
        if not step.capture:
            if self.meter is None and self._cold:
                print(_FIRST_STEP, file=sys.stderr, flush=True)
            meter.link(device)
            warm_up()
        record = StepRecord(
            family=fam,
            tokens=tokens,
            quad=quad,
            run=Run.PROBE,
            offloaded=len(offloaded),
            forced=False,
            exact=False,
            generation=fam.generation,
            predicted_s=None,
            predicted_peak=None,
            start_memory=memory,
            cold=self._cold,
        )
        self._watch(off, step, record, meter, device, True)
        step.stats.auto = {
            "phase": fam.phase.value,
            "step": Run.PROBE.value,
            "offloaded": offloaded,
            "tokens": tokens,
            "reason": "measuring: the first forward of these inputs offloads like 'all' "
            "(every call but the last: no more device memory than 'all') and times every "
            "layer with its copies in flight; later forwards offload what the link hides "
            "and what memory needs",
            "state": self.state_size(),
        }

    def _watch(
        self,
        off: Any,
        step: Any,
        record: StepRecord,
        meter: Meter,
        device: torch.device,
        probe: bool,
        memory: bool = True,
    ) -> None:
        fam = record.family
        if probe:
            # the first measurement of a kind of input counts the bytes every call saves;
            # a later one times the calls (the costs that change) and predicts the bytes,
            # so the calls not offloaded run without the saved-tensor hooks
            counts = fam.model is None
            watch: StepWatch = Probe(
                meter, device, record, True, counts, self.settings.host_seconds_per_copy
            )
            step.probe, step.counts = True, counts
            step.device, step.backend = device, off._runtime.backend(device)
            fam.probing = True
        else:
            watch = StepWatch(meter, device, record, memory)
        record.watch = watch
        step.watch = watch
        self._cold = False
        meter.begin(record)
        self.pending.append(record)
        while len(self.pending) > self.settings.max_pending:
            self._drop(self.pending.popleft())

    # ---- deciding ----------------------------------------------------------------------

    def _decide(
        self,
        fam: Family,
        sized: Sized,
        memory: DeviceMemory | None,
        meter: Meter,
        device: torch.device,
        cfg: Any,
    ) -> tuple[_auto.AutoDecision, Memory | None, dict[str, Any]]:
        """The choice at one size, its memory side and its JSON-ready form (the choice
        is made again only when something it depends on changed)."""
        est = sized.est
        mem = None
        if memory is not None and est.act_bytes is not None:
            limit = memory.limit * (1.0 - self.settings.memory_margin) - fam.memory_excess
            peak_all = memory.allocated + est.act_bytes
            floor = _auto.memory_floor(est.freed, peak_all, limit)
            none_peak = peak_all + sized.kept[0]
            mem = Memory(limit, peak_all, peak_all, none_peak <= limit, floor, none_peak)
        floor = mem.floor if mem is not None else 0
        stamp = (fam.generation, fam.scale, fam.backoff, floor)
        if sized.stamp != stamp or sized.decision is None:
            old = sized.stamp
            # only the scale moved (Family.observe): the choice it replaces
            scaled = old is not None and old[0] == stamp[0] and old[2:] == stamp[2:]
            before = sized.decision if scaled else None
            note = ""
            if mem is not None:
                note = (
                    f"{mem.limit / 2**30:.2f} GiB of device memory (the limit less "
                    f"{self.settings.memory_margin:.0%}) holds the step's predicted peak only with "
                    f"{floor} layers offloaded"
                )
            costs, gap = _scaled(est, fam.scale)
            d2h, h2d = meter.link(device)
            decide = functools.partial(
                _auto.choose,
                costs,
                d2h,
                h2d,
                cfg.max_slowdown,
                cfg.prefetch_layers,
                gap,
                min_offloaded=floor,
                memory_note=note,
                per_copy=self.settings.host_seconds_per_copy,
            )
            sized.decision = decide(backoff=fam.backoff)
            if (
                before is not None
                and fam.backoff < 0
                and before.time_offloaded != sized.decision.time_offloaded
            ):
                # a step up is one layer beyond the choice it was measured from; that
                # choice moved: the step up goes (the new choice may step up itself)
                fam.backoff = 0
                sized.decision = decide(backoff=0)
                stamp = (fam.generation, fam.scale, fam.backoff, floor)
            if before is not None and len(before.offloaded) != len(sized.decision.offloaded):
                fam.new_generation("the scale changed the choice: verifying again")
                stamp = (fam.generation, *stamp[1:])
            sized.stats = sized.decision.to_dict()
            sized.stamp = stamp
        decision = sized.decision
        if mem is not None:
            mem.peak = mem.peak_all + sized.kept[len(decision.offloaded)]
        return decision, mem, sized.stats  # type: ignore[return-value]

    def _next_run(self, fam: Family, decision: _auto.AutoDecision, mem: Memory | None) -> Run:
        """A step without offloading, or the choice (module docstring, ``VERIFY``)."""
        if not decision.offloaded:
            if fam.phase is Phase.VERIFY and len(fam.none) >= self.settings.min_pairs:
                # no layer to verify; watched like a settled choice from now on
                fam.settle("nothing to verify: no layer chosen at these sizes")
            return Run.NONE  # nothing offloaded: a step without offloading
        if fam.calibrate:
            # only far from the memory limit: the cold step's memory is the least sure
            if decision.memory_reason is None and _roomy(mem, self.settings.calibrate_room):
                return Run.NONE  # scales the cold measurement (``_measured``)
            fam.calibrate = False
        if fam.phase is not Phase.VERIFY:
            return Run.PLAN
        if mem is not None and not mem.none_fits:
            if decision.memory_reason is not None:
                fam.settle("forced by memory: a step without offloading would not fit")
                return Run.PLAN
            fam.blocked += 1
            if fam.blocked >= 2 * self.settings.verify_steps and not fam.none:
                fam.settle(
                    "not verified: memory never allowed a step without offloading at these sizes"
                )
            return Run.PLAN
        if fam.warmup > 0:
            return Run.PLAN  # not counted: the choice warms up (module docstring)
        if fam.round_none < self.settings.verify_steps and fam.last_run is Run.PLAN:
            return Run.NONE  # paired with the step of the choice after it
        return Run.PLAN

    # ---- reading what steps measured ---------------------------------------------------

    def _collect(self, max_slowdown: float) -> None:
        """Read the steps whose marks have completed (never waits, except once for a
        measuring forward whose backward ran)."""
        keep: collections.deque[StepRecord] = collections.deque()
        for record in self.pending:
            watch = record.watch
            if isinstance(watch, Probe):
                if watch.complete():
                    self._measured(record, watch)
                    continue
            elif watch is not None and watch.end is not None:
                seconds = watch.seconds()
                if seconds is not None:
                    record.family.observe(record, seconds, watch.end_memory, max_slowdown)
                    continue
            record.age += 1
            if record.age <= self.settings.max_pending:
                keep.append(record)
            else:
                self._drop(record)
        self.pending = keep

    def _drop(self, record: StepRecord) -> None:
        fam = record.family
        if record.run is Run.PROBE:
            fam.probing = False
        elif record.run is Run.NONE:
            fam.none_in_flight = max(0, fam.none_in_flight - 1)
            fam.calibrate = False

    def _measured(self, record: StepRecord, probe: Probe) -> None:
        """A measuring forward completed: keep its size's point."""
        fam = record.family
        fam.probing = False
        m = probe.result()
        if m is None:
            return
        L = len(m.forward_s)
        if not probe.counts:
            if fam.model is None or fam.model.num_groups != L:
                # the calls changed since the bytes were counted: measured afresh
                fam.model = None
                fam.sizes.clear()
                return
            _predicted_bytes(m, fam.model.predict(record.tokens, record.quad))
        act = None
        start, end = record.start_memory, probe.end_memory
        if start is not None:
            kept = sum(m.freed_bytes[record.offloaded : L - 1])
            if end is not None and end.peak > start.peak:
                peak: float | None = end.peak
            elif m.allocated_max is not None:
                # the peak was not reached in this step (an earlier one was higher):
                # the highest mark, and one call's bytes for what a call allocates
                peak = m.allocated_max + max(m.freed_bytes, default=0)
            else:
                peak = None
            if peak is not None:
                act = max(0.0, peak - start.allocated - kept)
                if end is not None:  # what the allocator reserved beyond this peak
                    fam.learn_memory(start, end, peak)
        fwd, bwd, host_fwd, host_bwd = steady(
            (m.forward_s, m.backward_s, m.host_forward_s, m.host_backward_s),
            m.link_bytes,
            self.settings,
        )
        point = Point(
            record.tokens,
            record.quad,
            point_values(
                fwd,
                bwd,
                host_fwd,
                host_bwd,
                m.link_bytes,
                m.freed_bytes,
                m.gap_s,
                act,
            ),
            m.copies,
            act,
            cold=record.cold,
        )
        if fam.model is None or fam.model.num_groups != L:
            fam.model = ShapeModel(L, self.settings)
            fam.sizes.clear()
        fam.model.add(point)
        fam.rescale()  # the base predictions changed with the points
        fam.warmup = self.settings.warmup_steps  # the first steps after a measuring forward
        if fam.phase is Phase.MEASURE:
            fam.phase = Phase.VERIFY
        if all(p.cold for p in fam.model.points):
            # measured again, warm, at the choice's own plan; first a step without
            # offloading (where memory allows) scales the cold costs that choice uses
            fam.reprobe = fam.calibrate = True
