"""The planner's guarantee and its model of a real model's memory, on the CPU with
synthetic costs: the single-lever plans are always candidates and always measured, a
plan that measures slower than the best of them is replaced by it, the head's memory
is modelled apart from the layers' (an HF-Llama-like case that a single workspace
declares infeasible), compression is chosen per layer, and the plan reports how far
its predictions were from what was measured."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from offload._planner import search as _search
from offload._planner import verify as _verify
from offload._planner.costs import PlanCosts
from offload._planner.fit import moments_of
from offload._planner.plan import Plan
from offload._planner.settings import PlannerSettings
from offload.models import ReferenceModel

DEFAULTS = PlannerSettings()

MIB, GIB = 1 << 20, 1 << 30


def _llama_like(**kw) -> PlanCosts:
    """Sixteen layers shaped like HF Llama ~1.1B at seq 4096 (hidden 2048, bf16): a
    layer saves 0.34 GiB, its inputs (what a checkpoint keeps) are 16 MiB, a copy of a
    whole layer takes longer than its forward and backward (55 GB/s), and the head and
    loss (the logits in fp32 and their gradient) need 1.5 GiB that no lever touches:
    about what was measured on an H200 (6.97 GiB without levers, 1.53 GiB with every
    layer checkpointed and its inputs offloaded)."""
    L = 16
    fields = dict(
        forward_s=[1.3e-3] * L,
        backward_s=[2.7e-3] * L,
        saved_bytes=[int(0.34 * GIB)] * L,
        selective_kept=0.55,
        checkpoint_kept=16 * MIB / (0.34 * GIB),
        selective_s=[0.3e-3] * L,
        checkpoint_s=[1.3e-3] * L,
        d2h_bps=55e9,
        h2d_bps=55e9,
        workspace_bytes=100 * MIB,
        head_bytes=int(1.5 * GIB),
        gap_s=3e-3,
    )
    fields.update(kw)
    return PlanCosts(**fields)


def _layers(n: int) -> torch.nn.ModuleList:
    return torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))


# ---- the memory model: the head apart ---------------------------------------------------


def test_the_head_is_a_moment_of_its_own() -> None:
    """With ``head_bytes`` the workspace counts at the layers' moments only, and the
    moment between the last forward and its backward holds the residents plus ``H``."""
    c = _llama_like()
    L, S, W, H = 16, c.saved_bytes[0], c.workspace_bytes, c.head_bytes
    keep = ["keep"] * L
    assert c.raw_memory(keep) == pytest.approx(L * S + max(W, H))
    ckpt = ["checkpoint"] * L
    inputs = c.checkpoint_kept * S
    assert c.raw_memory(ckpt) == pytest.approx(max(L * inputs + H, (L - 1) * inputs + S + W))
    legacy = dataclasses.replace(c, head_bytes=None, workspace_bytes=W + H)
    # one workspace counts H at every layer's moment too
    assert legacy.raw_memory(ckpt) == pytest.approx((L - 1) * inputs + S + W + H)
    assert legacy.raw_memory(ckpt) > c.raw_memory(ckpt)


def test_llama_like_quarter_budget_is_feasible_with_the_head_apart() -> None:
    """The case that made the planner declare 25 % infeasible on HF Llama: with one
    workspace (the step's peak minus the saved bytes, counted at every moment) the
    smallest feasible peak is above 25 %; with the head apart the budget is met, and
    the smallest feasible peak is what checkpointing every layer with offloaded inputs
    (HF checkpointing plus ``offload_checkpointing()``) reaches, but for the last
    layer's inputs (the offloader never offloads the last layer)."""
    c = _llama_like()
    L = c.num_layers
    base = c.memory(["keep"] * L)
    # what fit_costs makes without the moments: the step's peak minus the saved bytes
    legacy = dataclasses.replace(
        c, head_bytes=None, workspace_bytes=max(c.workspace_bytes, c.head_bytes)
    )
    budget = 0.25 * base
    with pytest.raises(ValueError, match="smallest feasible"):
        _search.optimize(legacy, budget)
    got = _search.optimize(c, budget)
    assert c.memory(got) <= budget
    hf_offloaded = c.head_bytes  # every input offloaded: the head's moment is the peak
    last_input = c.checkpoint_kept * c.saved_bytes[-1]
    ranked = _search.candidates(c, hf_offloaded + last_input)
    assert min(c.memory(lv) for _, lv in ranked) <= hf_offloaded + last_input


def test_moments_from_the_peaks_between_boundaries() -> None:
    """``(W, H)`` from the allocator's peak of each span between layer boundaries: the
    span after a forward start is that layer's forward, the one after the last forward
    end the head, the one after a backward start that layer's backward."""
    before, S = 1000, [100, 100]
    marks = [
        ("forward_start", 0, before + 5),
        ("forward_end", 0, before + 130),  # forward 0: 100 saved + 30
        ("forward_start", 1, before + 100),
        ("forward_end", 1, before + 210),  # forward 1: 200 saved + 10
        ("backward_start", 1, before + 700),  # the head: 200 + 500
        ("backward_start", 0, before + 250),  # backward 1: 200 + 50
        ("backward_end", 1, before + 100),
        ("end", -1, before + 140),  # backward 0: 100 + 40
    ]
    assert moments_of(marks, before, S) == (50, 500)
    assert moments_of(marks[:3], before, S) is None  # not a whole step
    assert moments_of([("forward_start", 5, 0), ("end", -1, 0)], before, S) is None


# ---- single levers ---------------------------------------------------------------------


def test_single_levers() -> None:
    c = _llama_like(d2h_bps=1e15, h2d_bps=1e15)  # every copy hides
    got = dict(_search.single_levers(c))
    L = c.num_layers
    assert got["keep"] == ["keep"] * L
    assert got["offload"] == ["offload"] * (L - 1) + ["keep"]
    assert got["selective"] == ["selective"] * L and got["checkpoint"] == ["checkpoint"] * L
    assert got["checkpoint_offload"] == ["checkpoint_offload"] * (L - 1) + ["checkpoint"]
    slow = dict(_search.single_levers(_llama_like(d2h_bps=1e6, h2d_bps=1e6)))
    assert "offload" not in slow  # not one layer's copy hides
    some = dict(_search.single_levers(_llama_like()))
    k = some["offload"].count("offload")
    assert 0 < k < L - 1 and some["offload"] == ["offload"] * k + ["keep"] * (L - k)
    c2 = _llama_like()
    limit = c2.seconds(["keep"] * L) * (1 + DEFAULTS.hidden_slowdown)
    assert c2.seconds(some["offload"]) <= limit  # the longest prefix that hides
    assert c2.seconds(["offload"] * (k + 1) + ["keep"] * (L - k - 1)) > limit
    only = dict(_search.single_levers(c, ["checkpoint_offload"]))
    assert set(only) == {"keep", "checkpoint_offload"}
    assert only["checkpoint_offload"][-1] == "keep"


@pytest.mark.parametrize("seed", range(6))
def test_every_single_lever_that_fits_is_a_candidate(seed: int) -> None:
    rng = random.Random(seed)
    L = rng.randint(3, 9)
    c = _llama_like(
        forward_s=[rng.uniform(0.5, 2) * 1e-3 for _ in range(L)],
        backward_s=[rng.uniform(1, 4) * 1e-3 for _ in range(L)],
        saved_bytes=[rng.randint(50, 400) * MIB for _ in range(L)],
        selective_kept=rng.uniform(0.3, 0.8),
        checkpoint_kept=rng.uniform(0.01, 0.2),
        selective_s=[rng.uniform(0.1, 1) * 1e-3 for _ in range(L)],
        checkpoint_s=[rng.uniform(0.5, 2) * 1e-3 for _ in range(L)],
        d2h_bps=rng.choice([20e9, 55e9, 1e12]),
        h2d_bps=rng.choice([20e9, 55e9, 1e12]),
        head_bytes=rng.choice([None, 300 * MIB]),
    )
    for fraction in (0.9, 0.5, 0.2):
        budget = fraction * c.memory(["keep"] * L)
        singles = [lv for _, lv in _search.single_levers(c) if c.memory(lv) <= budget]
        if not singles:
            continue
        ranked = [lv for _, lv in _search.candidates(c, budget)]
        for lv in singles:
            assert lv in ranked


# ---- the guarantee, measured ------------------------------------------------------------


def _measured(monkeypatch, table, default):
    """``measure_step`` replaced: ``table`` maps levers to (peak, seconds); every plan
    applied is recorded."""
    tried: list[list[str]] = []
    apply = Plan.apply

    def recording_apply(self, model=None):
        tried.append(list(self.levers))
        return apply(self, model)

    def fake(step_fn, steps, warmup):
        peak, seconds = table.get(tuple(tried[-1]), default(tried[-1]))
        return {"seconds": seconds, "peak_bytes": peak, "times": [seconds] * steps}

    monkeypatch.setattr(Plan, "apply", recording_apply)
    monkeypatch.setattr(_verify, "measure_step", fake)
    return tried


def test_a_plan_slower_than_checkpointing_everything_is_replaced(monkeypatch) -> None:
    """The HF-Llama case: the model ranks a mixed plan first, but checkpointing every
    layer measures faster (the model errs on the mixed plan's copies): the plan
    returned is checkpointing every layer, measured in alternating rounds with it."""
    c = _llama_like()
    L = c.num_layers
    budget = 0.5 * c.memory(["keep"] * L)
    ranked = _search.candidates(c, budget)
    mixed = ranked[0][1]
    ckpt = ["checkpoint"] * L
    assert mixed != ckpt and c.memory(ckpt) <= budget
    assert c.seconds(mixed) < c.seconds(ckpt)  # the model prefers the mixed plan
    base = c.seconds(["keep"] * L)
    table = {tuple(ckpt): (0.3 * budget, 1.47 * base)}
    tried = _measured(monkeypatch, table, lambda lv: (0.9 * budget, 1.64 * base))
    layers = _layers(L)
    start = Plan(layers, ["keep"] * L, costs=c)
    got = start.replan(int(budget), step_fn=lambda: None, model=torch.nn.Sequential(*layers))
    assert got.levers == ckpt
    assert tried[0] == mixed and ckpt in tried
    checks = got.measured["checks"]
    singles = {ch["single"]: ch for ch in checks if "single" in ch}
    assert "checkpoint" in singles and singles["checkpoint"]["fits"]
    fitting = {n for n, lv in _search.single_levers(c) if c.memory(lv) <= budget}
    assert set(singles) == fitting and "checkpoint_offload" in fitting  # all measured
    assert all("pooled_seconds" in ch for ch in checks if ch["levers"] in (mixed, ckpt))
    # the mixed plan measures faster than every single lever: it stays
    table = {tuple(lv): (0.3 * budget, 1.64 * base) for _, lv in _search.single_levers(c)}
    table[tuple(ckpt)] = (0.3 * budget, 1.47 * base)
    tried = _measured(monkeypatch, table, lambda lv: (0.9 * budget, 1.10 * base))
    got = start.replan(int(budget), step_fn=lambda: None, model=torch.nn.Sequential(*layers))
    assert got.levers == mixed


def _against_checkpointing(monkeypatch, gains_of) -> tuple[dict, dict, list[list[str]]]:
    """Half of ``_llama_like``'s peak as the budget; every single lever that fits
    measures slower than checkpointing every layer (the best single lever), and a plan
    ranked i-th measures ``gains_of[i][j]`` faster than it in its j-th measurement (the
    first, then the rounds); other plans slower still. Returns the plan (its levers and
    checks), the measurements seen per ranked plan, and the ranking's levers."""
    c = _llama_like()
    L = c.num_layers
    budget = 0.5 * c.memory(["keep"] * L)
    ranked = [lv for _, lv in _search.candidates(c, budget)]
    base = c.seconds(["keep"] * L)
    single_s = 1.30 * base
    table = {tuple(lv): (0.3 * budget, 1.6 * base) for _, lv in _search.single_levers(c)}
    table[tuple(["checkpoint"] * L)] = (0.3 * budget, single_s)
    tried = _measured(monkeypatch, table, lambda lv: (0.9 * budget, 1.7 * base))
    gains = {tuple(ranked[i]): g for i, g in gains_of.items()}
    seen = dict.fromkeys(gains, 0)
    measure = _verify.measure_step

    def per_round(step_fn, steps, warmup):
        got = measure(step_fn, steps, warmup)
        key = tuple(tried[-1])
        if key in gains:
            seconds = single_s * (1.0 - gains[key][seen[key]])
            seen[key] += 1
            got = {**got, "seconds": seconds, "peak_bytes": 0.9 * budget}
            got["times"] = [seconds] * steps
        return got

    monkeypatch.setattr(_verify, "measure_step", per_round)
    layers = _layers(L)
    start = Plan(layers, ["keep"] * L, costs=c)
    got = start.replan(int(budget), step_fn=lambda: None, model=torch.nn.Sequential(*layers))
    return {"levers": got.levers, "checks": got.measured["checks"]}, seen, ranked


@pytest.mark.parametrize(
    ("gains", "stays"),
    [
        ((0.005, 0.005, 0.005), False),  # ahead in every round, by less than verify_gain
        ((0.015, 0.015, 0.015), True),  # ahead by more, in every round
        ((0.06, 0.06, -0.01), False),  # far ahead pooled, behind in the last round
        ((-0.05, 0.015, 0.015), True),  # behind only in the first measurement
    ],
)
def test_a_plan_ahead_of_the_best_single_lever_stays_only_when_ahead_in_every_round(
    monkeypatch, gains: tuple[float, float, float], stays: bool
) -> None:
    """Note [plan against the single lever]: the model's choice measures ``gains[i]``
    faster than checkpointing every layer (the best single lever) in its i-th
    measurement; it stays only when it is verify_gain faster pooled and faster in every
    round (the other plans measure slower than checkpointing)."""
    got, seen, ranked = _against_checkpointing(monkeypatch, {0: gains})
    mixed = ranked[0]
    assert seen[tuple(mixed)] == 1 + DEFAULTS.verify_rounds  # the first, then the rounds
    assert got["levers"] == (mixed if stays else ["checkpoint"] * len(mixed))
    (plan,) = [ch for ch in got["checks"] if ch["levers"] == mixed]
    assert len(plan["rounds"]) == DEFAULTS.verify_rounds


@pytest.mark.parametrize(
    ("rival_gains", "rival_stays"),
    [
        ((0.015, 0.015, 0.015), True),  # ahead of the single lever in every round
        ((0.03, 0.03, -0.005), False),  # behind it in the last round
    ],
)
def test_a_rival_ahead_in_every_round_takes_the_place_of_a_plan_that_is_not(
    monkeypatch, rival_gains: tuple[float, float, float], rival_stays: bool
) -> None:
    """Note [plan against the single lever]: the model's choice measures far ahead of
    checkpointing every layer pooled but behind it in the last round, so it does not
    stay; the rival measured with it, slower pooled, takes its place when it is ahead in
    every round, else the single lever is the plan."""
    got, seen, ranked = _against_checkpointing(
        monkeypatch, {0: (0.06, 0.06, -0.01), 1: rival_gains}
    )
    assert all(n == 1 + DEFAULTS.verify_rounds for n in seen.values())  # both measured
    rival = ranked[1]
    assert got["levers"] == (rival if rival_stays else ["checkpoint"] * len(rival))


def test_when_no_plan_fits_the_best_single_lever_that_does_is_the_plan(monkeypatch) -> None:
    c = _llama_like()
    L = c.num_layers
    budget = 0.5 * c.memory(["keep"] * L)
    ckpt_off = ["checkpoint_offload"] * (L - 1) + ["checkpoint"]
    table = {tuple(ckpt_off): (0.25 * budget, 1.4)}
    _measured(monkeypatch, table, lambda lv: (1.5 * budget, 1.0))  # everything else over
    layers = _layers(L)
    start = Plan(layers, ["keep"] * L, costs=c)
    got = start.replan(int(budget), step_fn=lambda: None, model=torch.nn.Sequential(*layers))
    assert got.levers == ckpt_off
    tuning = PlannerSettings(verify_single=False)
    with pytest.raises(ValueError, match="measured above it"):
        start.replan(
            int(budget), step_fn=lambda: None, model=torch.nn.Sequential(*layers), settings=tuning
        )


# ---- compression per layer --------------------------------------------------------------


def test_compression_only_where_it_buys_time() -> None:
    """Costs measured with ``compress``: a layer whose copies hide travels exactly; a
    link-bound one is compressed when that shortens the predicted step."""
    L = 6
    S = 100 * MIB
    c = PlanCosts(
        forward_s=[1e-3] * L,
        backward_s=[2e-3] * L,
        saved_bytes=[S] * L,
        link_bytes=[S // 2] * L,
        selective_kept=0.6,
        checkpoint_kept=0.05,
        selective_s=[0.3e-3] * L,
        checkpoint_s=[1e-3] * L,
        d2h_bps=S / 2.5e-3,  # a whole layer's copy: 2.5 ms, about what one forward hides
        h2d_bps=S / 2.5e-3,
        offload_s=[0.1e-3] * L,
    )
    one = ["offload"] + ["keep"] * (L - 1)
    assert _search.compression(c, one) == [False] * L  # hides exactly: no loss for nothing
    most = ["offload"] * (L - 1) + ["keep"]
    mask = _search.compression(c, most)
    assert any(mask) and not mask[-1]
    assert c.seconds(most, mask) < c.seconds(most, [False] * L)
    exact = ["offload"] * (L - 1) + ["keep"]
    assert c.seconds(exact, [False] * L) == pytest.approx(
        dataclasses.replace(c, link_bytes=None, offload_s=None).seconds(exact)
    )
    with pytest.raises(ValueError, match="compressed is set but compress=None"):
        Plan(_layers(L), most, compressed=mask)
    with pytest.raises(ValueError, match="one per layer"):
        Plan(_layers(L), most, compress="fp8", compressed=[True])


def test_only_the_compressed_layers_are_compressed() -> None:
    """Applied on the reference block in bf16: only the layers marked compressed send
    fp8; a plan with none marked trains bitwise like the model without it."""
    torch.manual_seed(0)
    model = ReferenceModel(4, 64, 4, 160, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    levers = ["offload"] * 3 + ["keep"]
    mask = [True, False, False, False]
    p = Plan(model.layers, levers, compress="fp8", compressed=mask, min_tensor_bytes=0)
    p.apply(model)
    try:
        model.loss(x).backward()
        sent = [la.bytes_offloaded for la in p.offloader.stats.layers]
        assert 0 < sent[0] < 0.6 * sent[1] and sent[1] == sent[2] > 0
        assert p.offloader.stats.compress_bytes_before > 0
    finally:
        p.remove()
    assert not any(layer._forward_pre_hooks for layer in model.layers)
    p = Plan(model.layers, levers, compress="fp8", compressed=[False] * 4, min_tensor_bytes=0)
    p.apply(model)
    try:
        for m in (model, ref):
            for q in m.parameters():
                q.grad = None
        model.loss(x).backward()
        ref.loss(x).backward()
        assert p.offloader.stats.bytes_offloaded > 0
        assert p.offloader.stats.compress_bytes_before == 0
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad)
    finally:
        p.remove()


# ---- the report -------------------------------------------------------------------------


def test_prediction_errors_per_configuration() -> None:
    c = _llama_like()
    L = c.num_layers
    measured = {
        "configs": {
            "none": {"seconds": 0.065, "peak_bytes": 7.0 * GIB},
            "offload": {"seconds": 0.2, "peak_bytes": 2.0 * GIB},
            "checkpoint": {"seconds": 0.095, "peak_bytes": 1.8 * GIB},
        },
        "checks": [
            {
                "levers": ["checkpoint_offload"] * (L - 1) + ["checkpoint"],
                "measured_seconds": 0.09,
                "pooled_seconds": 0.088,
                "measured_bytes": 1.5 * GIB,
                "rival": False,
                "single": "checkpoint_offload",
            }
        ],
    }
    p = Plan(_layers(L), ["checkpoint"] * L, costs=c, measured=measured)
    rows = p.prediction_errors()
    assert [r["name"] for r in rows] == [
        "none",
        "all offload",
        "all checkpoint",
        "single checkpoint_offload",
    ]
    last = rows[-1]
    assert last["measured_seconds"] == 0.088  # the pooled median when there is one
    assert last["time_error"] == pytest.approx(last["predicted_seconds"] / 0.088 - 1)
    assert last["memory_error"] == pytest.approx(last["predicted_bytes"] / (1.5 * GIB) - 1)
    assert rows[1]["fitted"] == [] and rows[2]["fitted"] == ["seconds", "bytes"]
    assert p.to_dict()["errors"] == rows
    from rich.console import Console

    console = Console(record=True, width=120)
    p.report(console)
    text = console.export_text()
    assert "the cost model against the steps measured" in text
    assert "single checkpoint_offload" in text
    assert Plan(_layers(2), ["keep", "keep"]).prediction_errors() == []
