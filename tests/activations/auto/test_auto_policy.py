"""offload_layers="auto" as a policy, on the CPU with injected timings and
device memory (tests/auto_fake.py): memory first, sizes carried across lengths, the
base measured without the instrumentation, back-off and re-decision after a measured
slowdown, bounded state. Every step's gradients are bitwise equal to the same model
without offloading."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from torch import nn

import offload
from offload.activations._auto import _policy as _auto_policy
from offload.activations._auto._predict import LayerCost, choose, predict_step
from offload.activations._control import Internals
from tests import models
from tests.auto_fake import AUTO, FakeMemory, FakeMeter, one_thread, state_bounds  # noqa: F401
from tests.models import assert_same, step, twin

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(n_layers: int, dim: int = 64, **kw):
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(dim, **kw) for _ in range(n_layers))
    return layers, twin(layers)


def _auto_offloader(layers, meter: FakeMeter) -> offload.ActivationOffloader:
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)  # "auto", the default
    assert off.config.offload_layers == "auto"
    Internals(off).use_meter(meter)
    return off


def _run(layers, ref, off, seq: int, dim: int = 64, batch: int = 2) -> dict:
    """One step under ``off`` and the same step without offloading: bitwise equal."""
    x = torch.randn(batch, seq, dim)
    assert_same(step(layers, x, models.run_plain, off), step(ref, x, models.run_plain))
    auto = dict(off.stats.auto)
    auto["sent"] = off.stats.bytes_offloaded
    auto["ran"] = [la.index for la in off.stats.layers if la.offloaded]
    auto["ran_recomputed"] = [la.index for la in off.stats.layers if la.recomputed]
    return auto


def _released(layers, seq: int, batch: int = 2, dim: int = 64) -> list[int]:
    """Device bytes each call frees when offloaded (``"all"``; the last: 0)."""
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=1024)
    step(layers, torch.randn(batch, seq, dim), models.run_plain, off)
    off.close()
    return [la.bytes_released for la in off.stats.layers]


def _family(off) -> _auto_policy.Family:
    """The policy's one family, live: its fitted model's predictions, the policy's own
    methods and a scale set by hand need the object (what a test only reads comes from
    ``off.last_step.auto_state``)."""
    (fam,) = Internals(off).auto_policy.families.values()
    return fam


# ---- memory first ------------------------------------------------------------------------


def _memory_first(link_seconds: float) -> tuple[list[dict], FakeMemory, int, int]:
    """Six layers whose step fits the device only with the first four offloaded (or
    their saves off the device otherwise); the link sends a layer's saves in
    ``link_seconds`` (a layer's forward: 0.5 ms)."""
    L, need = 6, 4
    layers, ref = _model(L)
    freed = _released(layers, 16)
    link = freed[0] / link_seconds
    base, act = 50 << 20, 3 * max(freed)
    peak_needed = base + act + sum(freed[need : L - 1])
    limit = int(peak_needed / (1 - AUTO.memory_margin)) + 1
    memory = FakeMemory(limit, base, lambda n: act, lambda n: freed)
    costs = [LayerCost(0.5e-3, 1e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, link, memory=memory)
    off = _auto_offloader(layers, meter)
    seen = []
    for it in range(12):
        auto = _run(layers, ref, off, 16)  # bitwise equal to no offloading
        seen.append(auto)
        assert auto["sent"] > 0, (it, auto)  # offloads from the first step on
        assert auto["step"] != "none", auto  # a step without offloading would not fit
    assert seen[0]["step"] == "probe" and seen[0]["ran"] == list(range(L - 1))
    # the simulated device never held more than its limit
    assert max(p for _, _, p in memory.peaks) <= limit
    assert seen[-1]["phase"] == "settled"
    assert "memory" in off.stats.summary()
    off.close()
    return seen, memory, L, need


def test_memory_first_offloads_what_memory_needs_from_the_first_step() -> None:
    # a link twice as slow as the forward: the link hides two layers; offloading the
    # four memory needs stalls less than recomputing the four past the link's choice
    seen, memory, L, need = _memory_first(1.0e-3)
    for auto in seen[1:]:
        assert len(auto["ran"]) >= need, auto
        assert auto["time_offloaded"] < need
        assert auto["memory_reason"] and "memory" in auto["reason"], auto
        assert auto["memory"]["floor"] == len(auto["ran"])
        assert auto["memory"]["peak"] <= auto["memory"]["limit"]
        assert "recomputed" not in auto


def test_memory_first_recomputes_past_the_link_when_offloading_would_stall_more() -> None:
    # link-bound layers (a layer's saves take 8x its forward on the link): the link's
    # choice is offloaded and every later call runs recomputed, its inputs offloaded
    # (Note [recomputed calls]), rather than stalling on four copies
    seen, memory, L, need = _memory_first(4e-3)
    for auto in seen[1:]:
        assert auto["time_offloaded"] < need
        assert auto["memory_reason"] and "memory" in auto["reason"], auto
        k = auto["time_offloaded"]
        assert auto["recomputed"] == list(range(k, L)), auto
        assert auto["ran"] == list(range(L)), auto  # recomputed calls offload inputs
        assert "recomputed" in auto["reason"]
    # the first call's wrapper goes on before the next step's first call (the choice is
    # made at that call's start: Note [recomputed calls]); the others at once
    assert seen[1]["ran_recomputed"] == [i for i in seen[1]["recomputed"] if i > 0]
    for auto in seen[2:]:
        assert auto["ran_recomputed"] == auto["recomputed"], auto
    assert max(p for _, _, p in memory.peaks) <= memory.limit


def test_no_step_without_offloading_when_memory_cannot_hold_one() -> None:
    # memory holds everything but the whole step without offloading: the link's choice
    # (two layers) fits, a verifying step with none does not
    L = 4
    layers, ref = _model(L)
    freed = _released(layers, 16)
    base, act = 10 << 20, max(freed)
    memory = FakeMemory(0, base, lambda n: act, lambda n: freed)
    memory.limit = int((base + act + sum(freed[1 : L - 1])) / (1 - AUTO.memory_margin))
    costs = [LayerCost(2e-3, 4e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, freed[0] / 1e-3, memory=memory)
    off = _auto_offloader(layers, meter)
    runs = [_run(layers, ref, off, 16) for _ in range(16)]
    assert all(a["step"] != "none" and a["sent"] > 0 for a in runs)
    assert max(p for _, _, p in memory.peaks) <= memory.limit


def test_memory_the_allocator_reserves_beyond_the_peak_counts_against_the_limit() -> None:
    # the per-process cap limits reserved memory: unused parts of segments at the peak
    # (fragmentation, ``slack``) are learnt from the first step and offloaded for
    L = 6
    layers, ref = _model(L)
    freed = _released(layers, 16)
    f = max(freed)
    base, act = f, 3 * f
    slack = freed[2] + freed[3]
    # allocated memory alone would need layers 0-1 offloaded; with the slack, 0-3
    limit = int((base + act + sum(freed[2 : L - 1])) / (1 - AUTO.memory_margin)) + 1
    memory = FakeMemory(limit, base, lambda n: act, lambda n: freed, slack=slack)
    costs = [LayerCost(0.5e-3, 1e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, freed[0] / 4e-3, memory=memory)
    off = _auto_offloader(layers, meter)
    runs = [_run(layers, ref, off, 16) for _ in range(8)]
    assert runs[0]["step"] == "probe" and all(a["sent"] > 0 for a in runs)
    (family,) = off.last_step.auto_state.families
    assert family.memory_excess >= slack
    # every step, the first included, reserved no more than the limit
    assert max(p for _, _, p in memory.peaks) + slack <= limit
    assert all(len(a["ran"]) >= 4 for a in runs[1:]), runs


@pytest.mark.parametrize("room", [0.9, 1.1, 4.0])
def test_the_step_after_the_first_runs_without_offloading_only_far_from_the_limit(
    room: float,
) -> None:
    # the first step's memory reading is the least sure: the calibrating step without
    # offloading runs only when its predicted peak is well inside the limit
    L = 4
    layers, ref = _model(L)
    freed = _released(layers, 16)
    base, act = 1 << 20, max(freed)
    none_peak = base + act + sum(freed[: L - 1])
    limit = int(room * none_peak / (1 - AUTO.memory_margin))
    memory = FakeMemory(limit, base, lambda n: act, lambda n: freed)
    costs = [LayerCost(2e-3, 4e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, freed[0] / 1e-3, memory=memory, cold_factor=3.0)
    off = _auto_offloader(layers, meter)
    runs = [_run(layers, ref, off, 16) for _ in range(3)]
    assert runs[0]["step"] == "probe"
    if room < 1 / AUTO.calibrate_room:
        assert runs[1]["step"] != "none" and runs[1]["sent"] > 0, runs[1]
    else:
        assert runs[1]["step"] == "none" and runs[1]["sent"] == 0, runs[1]
        assert runs[2]["step"] == "probe"  # measured again, warm, at the choice
    assert max(p for _, _, p in memory.peaks) <= limit


# ---- sizes carried across lengths -----------------------------------------------------


def _attention_costs(a: float, b: float, L: int):
    """Per call: forward ``a*n + b*q`` seconds (tokens, tokens * length), backward twice."""

    def costs(n: int) -> list[LayerCost]:
        q = n * (n // 2)  # batch 2
        return [
            LayerCost(a * n + b * q * (1 + i / L), 2 * (a * n + b * q * (1 + i / L)), 0)
            for i in range(L)
        ]

    return costs


def test_an_unseen_length_is_predicted_from_the_measured_ones() -> None:
    L = 4
    layers, ref = _model(L)
    true = _attention_costs(2e-6, 4e-8, L)
    meter = FakeMeter(true, 1e8, gap=lambda n: 1e-6 * n)
    off = _auto_offloader(layers, meter)
    for seq in (16, 16, 32, 64, 32, 64, 16, 64, 32, 16):
        _run(layers, ref, off, seq)
    model = _family(off).model
    measured = {p.tokens for p in model.points}
    assert 2 * 48 not in measured and len(measured) >= 2
    est = model.predict(2 * 48, 2 * 48 * 48)
    assert not est.exact
    for got, want in zip(est.costs, true(2 * 48)):
        assert got.forward_s == pytest.approx(want.forward_s, rel=0.01)
        assert got.backward_s == pytest.approx(want.backward_s, rel=0.01)
    assert est.gap_s == pytest.approx(1e-6 * 96, rel=0.01)
    # bytes: against what the calls really send at that length
    real = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=1024)
    step(layers, torch.randn(2, 48, 64), models.run_plain, real)
    for got, la in zip(est.costs[: L - 1], real.stats.layers):
        assert got.nbytes == pytest.approx(la.bytes_offloaded, rel=0.02)
    # the step at that length runs the prediction's choice, without measuring
    auto = _run(layers, ref, off, 48)
    assert auto["exact"] is False and auto["step"] != "probe"
    assert auto["sent"] > 0 or auto["step"] == "none"


def test_lengths_are_measured_again_only_when_the_prediction_proves_wrong() -> None:
    L = 3
    layers, ref = _model(L)
    # linear in tokens: one warm measurement predicts every length
    linear = FakeMeter(_attention_costs(2e-5, 0.0, L), 2e8)
    off = _auto_offloader(layers, linear)
    for seq in (16, 16, 24, 40, 56, 20, 48, 36, 60, 28):
        _run(layers, ref, off, seq)
    probes = [r for r in linear.records if r.run is _auto_policy.Run.PROBE]
    # the first step; then one step without offloading scales its cold costs, and the
    # step after it measures once more, warm
    assert [r.tokens for r in probes] == [32, 48]
    assert linear.records[1].run is _auto_policy.Run.NONE
    # attention-bound: lengths far from those measured are measured again, until the
    # fit holds; then no more
    quad = FakeMeter(_attention_costs(1e-6, 4e-7, L), 2e8)
    off = _auto_offloader(layers, quad)
    for seq in (16, 16, 64, 24, 56, 40, 48, 20, 60, 32, 44, 52, 28, 36):
        _run(layers, ref, off, seq)
    probes = [r for r in quad.records if r.run is _auto_policy.Run.PROBE]
    assert 3 <= len(probes) <= 5, [r.tokens for r in probes]
    last = quad.records.index(probes[-1])
    for seq in (18, 30, 42, 54, 62, 26):
        auto = _run(layers, ref, off, seq)
        assert auto["step"] != "probe" and auto["exact"] is False
    assert quad.records.index(probes[-1]) == last


def test_a_later_measurement_times_the_calls_and_predicts_their_bytes(monkeypatch) -> None:
    # the first measurement counts the bytes every call saves (each goes through the
    # saved-tensor hooks); a later one at another length only times the calls: those it
    # does not offload run without the hooks, and its bytes are the prediction's
    from offload.activations import _saves

    L = 4
    layers, ref = _model(L)
    meter = FakeMeter(_attention_costs(1e-6, 4e-7, L), 2e8)
    off = _auto_offloader(layers, meter)
    packs = []
    real_pack = _saves.Saves.pack
    monkeypatch.setattr(
        _saves.Saves, "pack", lambda self, t: (packs.append(self.open), real_pack(self, t))[1]
    )
    per_step = []
    for seq in (16, 16, 64, 24, 56, 40):
        packs.clear()
        auto = _run(layers, ref, off, seq)
        in_calls = [g for g in packs if g is not None]
        per_step.append((auto["step"], len(in_calls), {g.index for g in in_calls if g.offload}))
    first, later = per_step[0], [p for p in per_step[1:] if p[0] == "probe"]
    assert first[0] == "probe" and first[1] > 0
    assert later, per_step  # measured again (the first step's costs are cold)
    for _, n, offloaded in later:
        # only the offloaded calls' saves reach the hooks
        assert n == 0 or offloaded, per_step
    model = _family(off).model
    assert len(model.points) >= 2
    counted = {p.tokens: p for p in model.points}
    real = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=1024)
    for tokens, point in counted.items():
        step(layers, torch.randn(2, tokens // 2, 64), models.run_plain, real)
        est = model.predict(tokens, point.quad)
        for got, la in zip(est.costs[: L - 1], real.stats.layers):
            assert got.nbytes == pytest.approx(la.bytes_offloaded, rel=0.02), tokens


def test_a_later_measurement_of_a_changed_forward_counts_again() -> None:
    # the bytes are predicted only for the calls the counted measurement saw: when a
    # later measurement ran another number of calls, the model is dropped and the next
    # step measures afresh, counting
    from offload.activations._auto._probe import ProbeResult

    L = 3
    layers, ref = _model(L)
    meter = FakeMeter(_attention_costs(1e-6, 4e-7, L), 2e8)
    off = _auto_offloader(layers, meter)
    for seq in (16, 16):
        _run(layers, ref, off, seq)
    policy, fam = Internals(off).auto_policy, _family(off)
    assert fam.model is not None and fam.model.num_groups == L

    class Uncounted:
        counts, end_memory = False, None

        def result(self) -> ProbeResult:
            n = L + 1
            return ProbeResult(
                [1e-3] * n, [2e-3] * n, [0.0] * n, [0.0] * n, [0] * n, [0] * n, [0] * n,
                [False] * n, 0.0, None,
            )  # fmt: skip

    record = _auto_policy.StepRecord(
        family=fam, tokens=64, quad=64 * 32, run=_auto_policy.Run.PROBE, offloaded=0,
        forced=False, exact=False, generation=fam.generation, predicted_s=None,
        predicted_peak=None, start_memory=None,
    )  # fmt: skip
    policy._measured(record, Uncounted())
    assert fam.model is None and not fam.sizes
    auto = _run(layers, ref, off, 24)  # measured afresh, every call counted
    assert auto["step"] == "probe" and auto["ran"] == list(range(L - 1))
    _run(layers, ref, off, 24)  # its measurement is read before this step
    assert fam.model is not None and fam.model.num_groups == L
    assert all(c.nbytes > 0 for c in fam.model.predict(48, 48 * 24).costs[: L - 1])


# ---- the base, verification, back-off ----------------------------------------------------


def test_the_base_is_measured_without_the_instrumentation() -> None:
    # the measuring forward's hooks and marks make every layer look 1.8x slower than a
    # real step's: taken at face value, more copies would look hidden than are
    L = 6
    layers, ref = _model(L)
    freed = _released(layers, 16)
    costs = [LayerCost(1e-3, 2e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, freed[0] / 4.5e-3, probe_factor=1.8)
    off = _auto_offloader(layers, meter)
    runs = [_run(layers, ref, off, 16) for _ in range(14)]
    last = runs[-1]
    true = [
        dataclasses.replace(c, nbytes=b["nbytes"], copies=b["copies"])
        for c, b in zip(costs, last["costs"])
    ]
    inflated = [
        dataclasses.replace(c, forward_s=1.8 * c.forward_s, backward_s=1.8 * c.backward_s)
        for c in true
    ]
    right = choose(true, meter.bps, meter.bps, 0.03).offloaded
    assert len(choose(inflated, meter.bps, meter.bps, 0.03).offloaded) > len(right)  # the trap
    assert last["chosen"] == right, last
    assert last["scale"] == pytest.approx(1 / 1.8, rel=0.02)
    assert last["base_seconds"] == pytest.approx(
        sum(c.forward_s + c.backward_s for c in costs), rel=0.02
    )
    assert last["phase"] == "settled" and last["measured_ratio"] <= 1.03
    assert any(r["step"] == "none" for r in runs)  # verified against steps without offloading


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_a_step_read_late_does_not_scale_the_warm_costs_by_the_cold_ones(lag: int) -> None:
    # Note [stale predictions]: the host runs ``lag`` steps ahead of the device, and the
    # offloader's first step measured every time 14x too long (pinned memory, kernels):
    # a step without offloading read only after the warm measurement must not scale the
    # warm costs by its ratio to the cold prediction (about 1/14 here)
    L = 6
    layers, ref = _model(L)
    freed = _released(layers, 16)
    costs = [LayerCost(3e-3, 7e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, freed[0] / 1e-3, cold_factor=14.0, lag=lag)
    off = _auto_offloader(layers, meter)
    runs = [_run(layers, ref, off, 16) for _ in range(12)]
    warm = [r for r in runs if r.get("cold") is False]
    assert len(warm) >= 5, runs
    for r in warm:  # every report once measured warm: the true costs
        assert r["scale"] == pytest.approx(1.0, rel=0.02), r
        assert r["costs"][0]["forward_s"] == pytest.approx(3e-3, rel=0.02), r
    right = choose(
        [dataclasses.replace(c, nbytes=b["nbytes"], copies=b["copies"])
         for c, b in zip(costs, runs[-1]["costs"])],
        meter.bps, meter.bps, 0.03,
    ).offloaded  # fmt: skip
    assert right and runs[-1]["chosen"] == right, runs[-1]
    assert any(r["sent"] > 0 for r in warm)


@pytest.mark.parametrize("lag", [0, 2])
def test_back_off_one_layer_at_a_time_after_a_measured_slowdown_and_after_drift(
    lag: int,
) -> None:
    # compute-bound layers: the model hides every copy, but each offloaded layer costs
    # the real step 2 % it does not see; with ``lag`` the host runs two steps ahead of
    # the device (each step's time is read two steps later): the same end, later
    L = 6
    layers, ref = _model(L)
    costs = [LayerCost(5e-3, 10e-3, 0)] * L
    penalty = {"per_layer": 0.02}
    meter = FakeMeter(lambda n: costs, 1e10, lag=lag)
    none_s = sum(c.forward_s + c.backward_s for c in costs)
    meter.step_time = lambda n, k: none_s * (1 + penalty["per_layer"] * k)
    off = _auto_offloader(layers, meter)
    runs = [_run(layers, ref, off, 16) for _ in range(40 + 15 * lag)]
    chosen = [len(r["chosen"]) for r in runs[1:]]
    assert chosen[0] == L - 1
    steps = [b - a for a, b in zip(chosen, chosen[1:]) if b != a]
    assert steps and all(s == -1 for s in steps), chosen  # one layer at a time
    assert chosen[-1] == 1  # 1.02x: within 3 %; two layers: 1.04x
    assert runs[-1]["phase"] == "settled"
    assert runs[-1]["measured_ratio"] == pytest.approx(1.02, rel=1e-6)
    for r in runs:
        if r["step"] == "none":
            assert r["ran"] == [] and r["sent"] == 0
        else:
            assert r["ran"] == r["offloaded"] and (r["sent"] > 0) == bool(r["ran"])
    assert "measured 1.020x" in off.stats.summary()
    # conditions change: one offloaded layer now costs 4 %: the watch sees the drift,
    # a fresh verification measures it, and the layer comes off
    penalty["per_layer"] = 0.04
    runs = [_run(layers, ref, off, 16) for _ in range(AUTO.watch_every * 6 + 10)]
    assert any("drifted" in r["verification"] for r in runs)
    assert runs[-1]["chosen"] == [] and runs[-1]["sent"] == 0


def test_a_new_length_every_step_offloads_within_the_limit_from_the_second_step() -> None:
    # as a GPU shows it: the measuring forward reads every layer twice as slow as a real
    # step takes it, its first call pays the kernel selection of a new shape, and the
    # offloader's first step costs five times more; taken at face value, the choice
    # offloads layers whose copies stall. Real steps stall where the link cannot keep up.
    L = 8
    layers, ref = _model(L)
    true = _attention_costs(2e-5, 4e-8, L)
    released = {seq: _released(layers, seq) for seq in range(24, 65)}

    def real(n: int) -> list[LayerCost]:
        return [dataclasses.replace(c, nbytes=b) for c, b in zip(true(n), released[n // 2])]

    bps = real(96)[0].nbytes / 6e-3  # about two of eight layers hide at seq 48
    meter = FakeMeter(
        true,
        bps,
        probe_factor=2.0,
        first_call=5e-2,
        cold_factor=5.0,
        step_time=lambda n, k: predict_step(real(n), range(k), bps, bps, None, 0.0),
    )
    off = _auto_offloader(layers, meter)
    rng = random.Random(0)
    bounds = state_bounds()
    rows = []
    for i in range(40):
        seq = rng.randint(24, 64)
        auto = _run(layers, ref, off, seq)
        k = len(auto["offloaded"])
        n = 2 * seq
        ratio = meter.step_time(n, k) / meter.step_time(n, 0)
        best = len(choose(real(n), bps, bps, 0.03).offloaded)
        rows.append((i, seq, auto["step"], k, best, round(ratio, 4)))
        state = off.last_step.auto_state.state_size
        assert all(state[key] <= bounds[key] for key in bounds), (i, state)
        assert auto["ran"] == auto["offloaded"] and (auto["sent"] > 0) == (k > 0), (i, auto)
    later = rows[1:]
    assert all(r[5] <= 1.03 + 1e-9 for r in later), rows  # within the limit from step 2
    assert sum(r[2] == "none" for r in later) <= AUTO.verify_steps + 1, rows
    assert sum(r[2] == "probe" for r in later) <= 6, rows
    # and it offloads: on the steps of the choice, most of the layers that hide
    plan = [r for r in later if r[2] == "plan"]
    assert sum(r[3] for r in plan) >= 0.8 * sum(r[4] for r in plan), rows


def test_a_one_time_cost_in_one_call_does_not_move_the_choice() -> None:
    # the measuring forward's first call pays for kernel selection (or host memory
    # growth): ten layers' worth of time in one call, which no later step pays
    L = 6
    layers, ref = _model(L)
    costs = [LayerCost(1e-3, 2e-3, 0)] * L
    freed = _released(layers, 16)
    chosen = []
    for extra in (0.0, 3e-2):
        meter = FakeMeter(lambda n: costs, freed[0] / 4.5e-3, first_call=extra)
        off = _auto_offloader(layers, meter)
        runs = [_run(layers, ref, off, 16) for _ in range(4)]
        chosen.append(runs[-1]["chosen"])
        est = _family(off).model.predict(32, 32 * 16)
        assert est.costs[0].forward_s == pytest.approx(1e-3, rel=0.01)
        off.close()
    assert chosen[0] == chosen[1] and 0 < len(chosen[0]) < L - 1, chosen


# ---- bounded state ---------------------------------------------------------------------


def test_state_stays_bounded_over_a_thousand_lengths() -> None:
    # small blocks: the sizes, not the layers, are what this is about
    L, dim = 3, 16
    torch.manual_seed(0)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim)) for _ in range(L)
    )
    ref = twin(layers)
    meter = FakeMeter(_attention_costs(2e-6, 2e-9, L), 5e8)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    Internals(off).use_meter(meter)
    bounds = state_bounds()
    verifying = offloading = 0
    for i in range(1000):
        auto = _run(layers, ref, off, 8 + i, dim=dim, batch=1)
        state = off.last_step.auto_state.state_size
        assert all(state[k] <= bounds[k] for k in bounds), (i, state)
        if i and auto["chosen"]:
            if auto["step"] == "none":
                verifying += 1
            else:
                offloading += 1
                assert auto["sent"] > 0 and auto["ran"] == auto["chosen"], (i, auto)
    assert offloading > 900
    assert verifying <= 3 * AUTO.verify_steps
    assert len(meter.records) >= 1000 // AUTO.watch_every  # timed steps


# ---- verification at steady state, robust to noise ----------------------------------------


def _verifying_meter(
    L: int, ratio, none_noise=(1.0,), warm=(2, 1), slow: float = 1.08, link: float = 1e10
):
    """Compute-bound layers (at the default ``link``, bytes per second, the model hides
    every copy); a real step offloading ``k`` layers takes ``ratio(k)`` times the step
    without offloading. Steps without offloading cycle through ``none_noise``; the first
    ``warm[0]`` steps of a plan after a measuring forward, and ``warm[1]`` after a
    change of the plan, take ``slow`` times as long (the offloader warming up)."""
    costs = [LayerCost(5e-3, 10e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, link)
    none_s = sum(c.forward_s + c.backward_s for c in costs)
    nones = itertools.cycle(none_noise)  # one factor per step without offloading

    def step_time(n: int, k: int) -> float:
        if k == 0:
            return none_s * next(nones)
        before = [r for r in meter.records[:-1] if r.run is not _auto_policy.Run.NONE]
        since, last = 0, None
        for r in reversed(before):
            if r.run is _auto_policy.Run.PROBE or r.offloaded != k:
                last = r
                break
            since += 1
        cold = last is not None and (
            since < warm[0] if last.run is _auto_policy.Run.PROBE else since < warm[1]
        )
        return none_s * ratio(k) * (slow if cold else 1.0)

    meter.step_time = step_time
    return meter


def _slow_link(L: int, copy_s: float) -> tuple[float, list[int]]:
    """A link (bytes per second) over which a layer's saved bytes take ``copy_s`` at the
    size :func:`_settle` runs, and the bytes each call frees there."""
    freed = _released(_model(L)[0], 16)
    return freed[0] / copy_s, freed


def _settle(meter: FakeMeter, L: int, steps: int) -> list[dict]:
    layers, ref = _model(L)
    off = _auto_offloader(layers, meter)
    return [_run(layers, ref, off, 16) for _ in range(steps)]


def test_warm_up_steps_after_measuring_and_after_a_change_cause_no_back_off() -> None:
    # every offloaded layer is free at steady state; the offloader's first steps at a
    # plan are 8 % slower (pinned memory, reload buffers)
    L = 6
    runs = _settle(_verifying_meter(L, lambda k: 1.0), L, 24)
    chosen = [len(r["chosen"]) for r in runs[1:]]
    assert all(c == L - 1 for c in chosen), chosen  # never backed off
    assert runs[-1]["phase"] == "settled" and runs[-1]["measured_ratio"] <= 1.03, runs[-1]
    assert sum(r["step"] == "none" for r in runs) >= AUTO.min_pairs  # verified
    assert all(r["sent"] > 0 for r in runs if r["step"] != "none")


def test_noisy_steps_without_offloading_keep_free_layers() -> None:
    # the steps without offloading vary by 3 % either way (two fast, one slow): against
    # the fast ones a free plan looks 3.1 % slower
    L = 6
    runs = _settle(_verifying_meter(L, lambda k: 1.0, (0.97, 0.97, 1.03)), L, 30)
    chosen = [len(r["chosen"]) for r in runs[1:]]
    assert all(c == L - 1 for c in chosen), chosen
    assert runs[-1]["phase"] == "settled", runs[-1]
    assert "verified" in runs[-1]["verification"]
    nones = sum(r["step"] == "none" for r in runs)
    assert AUTO.min_pairs <= nones <= AUTO.verify_steps  # bounded


def test_a_real_slowdown_beyond_the_noise_still_backs_off() -> None:
    # the same noise; the full choice really costs 8 %, one layer fewer is free
    L = 6
    ratio = lambda k: 1.08 if k == L - 1 else 1.0  # noqa: E731
    runs = _settle(_verifying_meter(L, ratio, (0.97, 0.97, 1.03)), L, 40)
    chosen = [len(r["chosen"]) for r in runs[1:]]
    assert chosen[0] == L - 1 and chosen[-1] == L - 2, chosen
    assert runs[-1]["phase"] == "settled", runs[-1]
    assert all(r["sent"] > 0 for r in runs if r["step"] != "none")
    # bounded: the two rounds ran at most verify_steps steps without offloading each
    assert sum(r["step"] == "none" for r in runs) <= 2 * AUTO.verify_steps


def test_a_round_ends_on_a_host_whose_step_times_jitter() -> None:
    # every step, with or without offloading, varies by up to 25 % either way (a busy
    # host pacing small layers); every offloaded layer really costs 15 %. The scale the
    # steps read moves with the jitter: each round must still end within its steps
    # without offloading, instead of starting again at every move of the scale while
    # a choice nobody verified runs (Family.observe, AutoPolicy._decide)
    L = 3
    for seed in range(6):
        rng = random.Random(seed)
        meter = _verifying_meter(L, lambda k: 1.15 if k else 1.0)
        clean = meter.step_time
        meter.step_time = lambda n, k, clean=clean, rng=rng: clean(n, k) * rng.uniform(0.75, 1.25)
        runs = _settle(meter, L, 40)
        chosen = [len(r["chosen"]) for r in runs[1:]]
        settled = next((i for i, r in enumerate(runs) if r["phase"] == "settled"), None)
        assert settled is not None and settled <= 30, (seed, chosen)
        nones = sum(r["step"] == "none" for r in runs[:settled])
        assert nones <= L * AUTO.verify_steps, (seed, nones, chosen)
        assert all(r["sent"] > 0 for r in runs if r["step"] != "none")


@pytest.mark.parametrize(
    ("two", "noise", "kept"),
    [
        (1.02, (1.0,), True),
        (1.06, (1.0,), False),
        (1.015, (0.99, 1.01), True),
        (1.025, (0.99, 1.01), False),
    ],
)
def test_a_step_up_takes_one_more_layer_than_predicted_only_where_measured_within(
    two: float, noise: tuple[float, ...], kept: bool
) -> None:
    # a slow link: the model predicts one layer hidden and two at about 1.07x (within
    # step_up_reach times the limit), while a real step with two layers takes ``two``
    # times the step without offloading (the prediction on the safe side by one layer,
    # as on the GPU), three 1.10x. Within the limit: the second layer is kept; above
    # it: it comes off again and no step up is tried again. With steps without
    # offloading 1 % either side of their mean, a round of two layers at 1.025x reads
    # 1.035x against half of them: within the limit plus the noise (what a choice the
    # prediction made would keep), not within the limit a step up must meet
    L = 6
    link, _ = _slow_link(L, 15e-3)  # 15 ms a layer's copy, 5 ms its forward
    ratio = {0: 1.0, 1: 1.0, 2: two}
    meter = _verifying_meter(L, lambda k: ratio.get(k, 1.10), noise, link=link)
    runs = _settle(meter, L, 60)
    chosen = [len(r["chosen"]) for r in runs[1:]]
    assert chosen[0] == 1 and "2 would predict 1.0" in runs[1]["reason"], runs[1]
    moves = [(a, b) for a, b in zip(chosen, chosen[1:]) if b != a]
    assert runs[-1]["phase"] == "settled", runs[-1]
    if kept:
        assert moves == [(1, 2)], chosen
        assert "1 more than predicted" in runs[-1]["reason"]
    else:
        assert moves == [(1, 2), (2, 1)], chosen  # tried once, taken back
        assert runs[-1]["measured_ratio"] <= 1.03
    # bounded: each of the (at most three) rounds ran at most verify_steps steps
    # without offloading; every other step offloaded its choice
    assert sum(r["step"] == "none" for r in runs) <= len(moves) + 1 + 2 * AUTO.verify_steps
    assert all(r["sent"] > 0 and r["ran"] == r["offloaded"] for r in runs if r["step"] != "none")


def test_step_ups_repeat_while_each_measures_within_and_stop_at_the_first_that_does_not() -> None:
    # many layers, each a little more than its compute to copy (6.5 ms against 5 ms):
    # the predicted ratio grows by about 4 % a layer, so after a verified step up the
    # next layer is again predicted within reach. Real steps are the prediction for one
    # layer fewer (on the safe side by one layer, as on the GPU): the first step up
    # measures within the limit and is kept, the second does not and comes off, and no
    # further step up is tried; the run ends on the best fixed k within the limit
    L = 12
    link, freed = _slow_link(L, 6.5e-3)
    costs = [LayerCost(5e-3, 10e-3, b) for b in freed]
    base = predict_step(costs, [], link, link)
    predicted = [predict_step(costs, list(range(k)), link, link) / base for k in range(L)]
    real = [predicted[max(k - 1, 0)] for k in range(L)]
    best = max(k for k in range(L) if real[k] <= 1.03)
    choice = max(k for k in range(L) if predicted[k] <= 1.03)
    reach = 1 + AUTO.step_up_reach * 0.03
    assert best == choice + 1 and predicted[choice + 2] <= reach < predicted[choice + 3]
    runs = _settle(_verifying_meter(L, real.__getitem__, link=link), L, 60)
    chosen = [len(r["chosen"]) for r in runs[1:]]
    moves = [(a, b) for a, b in zip(chosen, chosen[1:]) if b != a]
    assert chosen[0] == choice, runs[1]
    assert moves == [(choice, best), (best, best + 1), (best + 1, best)], chosen
    assert runs[-1]["phase"] == "settled" and runs[-1]["measured_ratio"] <= 1.03, runs[-1]
    assert "1 more than predicted" in runs[-1]["reason"]
    # bounded: each of the three rounds ran at most verify_steps steps without offloading
    assert sum(r["step"] == "none" for r in runs) <= 3 * AUTO.verify_steps
    assert all(r["sent"] > 0 and r["ran"] == r["offloaded"] for r in runs if r["step"] != "none")


def test_a_step_up_goes_when_the_scale_moves_the_choice_it_stepped_from() -> None:
    # the setting above (two layers measured within the limit); once the step up to two
    # runs, the scale moves (as when steps read slower than the points: the first warm
    # steps) so that the prediction's own choice becomes two: the step up is dropped,
    # never stacked on the new choice (three layers, predicted far beyond reach)
    L = 6
    layers, ref = _model(L)
    link, _ = _slow_link(L, 15e-3)
    ratio = {0: 1.0, 1: 1.0, 2: 1.02}
    meter = _verifying_meter(L, lambda k: ratio.get(k, 1.10), link=link)
    off = _auto_offloader(layers, meter)
    runs, moved = [], None
    for i in range(40):
        runs.append(_run(layers, ref, off, 16))
        if moved is None and len(runs[-1].get("chosen", ())) == 2:
            _family(off).scale, moved = 1.3, i + 1
    assert moved is not None and runs[moved - 1]["backoff"] == -1, runs[moved - 1]
    after = runs[moved]
    assert after["time_offloaded"] == 2 and after["backoff"] == 0, after
    assert len(after["chosen"]) == 2
    reach = 1 + AUTO.step_up_reach * off.config.max_slowdown
    for r in runs[1:]:
        if r["backoff"] < 0:  # every step up ran a choice predicted within reach
            assert r["predicted_ratio"] <= reach, r


def _short(limit_of) -> tuple:
    """Four layers whose head, loss and weights (``act``, at the peak with every call
    offloaded) leave the device short by what ``limit_of(base, act)`` says."""
    L = 4
    layers, ref = _model(L)
    freed = _released(layers, 16)
    base, act = 50 << 20, 3 * max(freed)
    memory = FakeMemory(int(limit_of(base, act)), base, lambda n: act, lambda n: freed)
    costs = [LayerCost(0.5e-3, 1e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, freed[0] / 4e-3, memory=memory)
    return layers, ref, _auto_offloader(layers, meter), memory, base, act


def test_memory_short_by_measured_bytes_raises_before_the_step() -> None:
    # the head, loss and weights alone exceed the device: recomputing every layer call
    # cannot fit, and the bytes were measured at this size (the measuring forward ran
    # at it): the next step raises before its first layer runs (Note [memory short])
    layers, ref, off, memory, base, act = _short(lambda base, act: base + act / 2)
    _run(layers, ref, off, 16)  # the measuring forward (all offloaded)
    ran = len(memory.peaks)
    x = torch.randn(2, 16, 64)
    with pytest.raises(offload.ActivationMemoryError) as caught:
        step(layers, x, models.run_plain, off)
    assert len(memory.peaks) == ran  # raised before the step ran
    err = caught.value
    assert isinstance(err, torch.OutOfMemoryError)  # caught where an OOM would be
    assert err.needed_bytes > err.limit_bytes == memory.limit
    assert err.free_bytes == memory.limit - base
    text = str(err)
    assert str(err.needed_bytes) in text and str(err.free_bytes) in text
    for lever in ("offload.sliced_head_loss(model)", "offload.tile_mlp", "WeightOffloader"):
        assert lever in text
    # the offloader stays usable: the same step raises again
    with pytest.raises(offload.ActivationMemoryError):
        step(layers, x, models.run_plain, off)
    off.close()


def test_memory_short_only_past_the_margin_is_said_once() -> None:
    # past the limit less AutoSettings.memory_margin but within the device's own limit: the step may
    # fit (the prediction is not sure): a warning, no error
    margin = AUTO.memory_margin
    layers, ref, off, memory, base, act = _short(lambda base, act: (base + act) / (1 - margin / 2))
    with pytest.warns(UserWarning, match="outside the layers") as caught:
        for _ in range(4):
            auto = _run(layers, ref, off, 16)  # bitwise equal to no offloading
    assert auto["recomputed"], auto
    assert sum("outside the layers" in str(w.message) for w in caught) == 1
    assert "offload.sliced_head_loss(model)" in str(caught[0].message)
    off.close()


def test_memory_short_with_the_head_lever_installed_is_said_once() -> None:
    # the user installed the head lever on the model holding the layers: no error (the
    # levers outside the layers are theirs to size), the warning as before
    from offload._core import _levers

    layers, ref, off, memory, base, act = _short(lambda base, act: base + act / 2)
    holder = nn.Module()
    holder.layers = layers
    _levers.register_head(holder)
    try:
        with pytest.warns(UserWarning, match="outside the layers"):
            for _ in range(3):
                auto = _run(layers, ref, off, 16)
    finally:
        _levers.unregister_head(holder)
    assert auto["recomputed"], auto
    off.close()
