"""Offloaded inputs with every recompute lever, on the CPU: on synthetic costs shaped
like HF Llama ~1.1B the smallest feasible peak is at or below Hugging Face checkpointing
with ``offload_checkpointing()`` (the last layer's inputs leave the device before the
head, as that does); ``selective_offload_inputs`` (selective recompute whose inputs
travel) and ``checkpoint_offload`` on the last layer run bitwise like the model without
levers (on a tiny Hugging Face Llama too: ``tests/planner/test_planner.py``); the last layer's
group is released at its close; plans stay at least as fast as the best single lever
that fits; the plan's table shows what no lever touches."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from offload._planner import search as _search
from offload._planner.levers import NOT_LAST
from offload._planner.plan import Plan
from tests.planner.test_planner import _assert_same, _ref_model, _step, inject_measurements
from tests.planner.test_planner_guarantee import GIB, _layers, _llama_like, _measured


def _hf_offloaded(c) -> float:
    """What the model gives every layer checkpointed with its inputs offloaded (Hugging
    Face checkpointing plus ``offload_checkpointing()``), in the terms of
    ``offload/_planner/costs.py``: every input on the host while the head runs (``H``);
    at a layer's backward its recompute (``S + W``) and the inputs of the layer below,
    prefetched."""
    S, W, H = c.saved_bytes[0], c.workspace_bytes, c.head_bytes
    return max(H, S + W + c.checkpoint_kept * S)


def _smallest_feasible(c) -> float:
    """The smallest feasible peak the search reports (its error for a budget of 0)."""
    with pytest.raises(ValueError, match="smallest feasible") as info:
        _search.candidates(c, 0.0)
    return float(re.search(r"peak, ([0-9.]+) GiB", str(info.value)).group(1)) * GIB


# ---- the floor ---------------------------------------------------------------------------


def test_llama_like_floor_is_at_or_below_hf_checkpointing_with_offloaded_inputs() -> None:
    c = _llama_like()
    L = c.num_layers
    hf = _hf_offloaded(c)
    inputs = c.checkpoint_kept * c.saved_bytes[0]
    # the last layer's inputs kept: one layer input above it (the floor before)
    before = ["checkpoint_offload"] * (L - 1) + ["checkpoint"]
    assert c.memory(before) == pytest.approx(hf + inputs)
    # now a plan meets exactly that budget, with the last layer's inputs offloaded
    ranked = _search.candidates(c, hf)
    lowest = min((lv for _, lv in ranked), key=c.memory)
    assert c.memory(lowest) <= hf
    assert lowest[-1] in ("checkpoint_offload", "selective_offload_inputs")
    assert _smallest_feasible(c) <= hf + 0.0005 * GIB  # the message rounds to 1/1000 GiB
    # the plan returned for that budget fits it too
    assert c.memory(_search.optimize(c, hf)) <= hf


def test_llama_like_quarter_budget_anchored_on_the_measured_peaks() -> None:
    """Anchored on the H200's figures (6.97 GiB without levers; Hugging Face
    checkpointing with ``offload_checkpointing()`` 1.53 GiB): 25 % (1.74 GiB) is
    feasible and the smallest feasible peak is at or below 1.53 GiB."""
    c = _llama_like(activation_bytes=int(6.97 * GIB))
    assert c.memory(["keep"] * c.num_layers) == pytest.approx(6.97 * GIB, rel=1e-6)
    got = _search.optimize(c, 0.25 * 6.97 * GIB)
    assert c.memory(got) <= 0.25 * 6.97 * GIB
    assert _smallest_feasible(c) <= 1.53 * GIB + 0.0005 * GIB


def test_the_head_is_what_no_lever_touches() -> None:
    """Below the head's moment no plan fits: the floor is ``H`` (what the head and the
    loss need) when a layer's backward needs less."""
    c = _llama_like()
    assert _smallest_feasible(c) == pytest.approx(c.head_bytes, abs=0.0005 * GIB)
    with pytest.raises(ValueError, match="smallest feasible"):
        _search.candidates(c, 0.99 * c.head_bytes)


# ---- the lever in the cost model ---------------------------------------------------------


def test_selective_offload_inputs_in_the_cost_model() -> None:
    c = _llama_like()
    L, S = c.num_layers, c.saved_bytes[0]
    rho_s, rho_c = c.selective_kept, c.checkpoint_kept
    lever = "selective_offload_inputs"
    assert c.resident(0, lever) == pytest.approx((rho_s - rho_c) * S)
    assert c.travels(0, lever) == pytest.approx(rho_c * S)
    assert c.extra_seconds(0, lever) == c.extra_seconds(0, "selective") > 0
    # it keeps less than selective and sends less than selective_offload
    assert c.memory([lever] * L) < c.memory(["selective"] * L)
    assert c.link_total([lever] * L) < c.link_total(["selective_offload"] * (L - 1) + ["keep"])
    # a budget between the two is met with it, and not without it
    budget = (c.memory([lever] * L) + c.memory(["selective"] * L)) / 2
    got = _search.optimize(c, budget, levers=("selective", lever))
    assert lever in got and c.memory(got) <= budget
    with pytest.raises(ValueError, match="smallest feasible"):
        _search.optimize(c, budget, levers=("selective",))


def test_the_last_layer_takes_only_the_levers_that_send_its_inputs() -> None:
    layers = _layers(3)
    for lever in ("checkpoint_offload", "selective_offload_inputs"):
        assert Plan(layers, ["keep", "keep", lever]).levers[-1] == lever
    for lever in NOT_LAST:
        with pytest.raises(ValueError, match=f"last layer cannot be '{lever}'"):
            Plan(layers, ["keep", "keep", lever])
    c = _llama_like()
    for fraction in (0.6, 0.3, 0.23):
        for _, lv in _search.candidates(c, fraction * c.memory(["keep"] * c.num_layers)):
            assert lv[-1] not in NOT_LAST


# ---- the guarantee -----------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_never_slower_than_the_best_single_lever(monkeypatch, fraction: float) -> None:
    """Predicted: the first plan is at least as fast as every single lever that fits.
    Measured: when the single levers measure faster than predicted (and the plans as
    predicted), the plan returned is no slower than the fastest of them that fits."""
    c = _llama_like()
    L = c.num_layers
    budget = fraction * c.memory(["keep"] * L)
    singles = {tuple(lv) for _, lv in _search.single_levers(c) if c.memory(lv) <= budget}
    assert singles
    ranked = _search.candidates(c, budget)
    assert ranked[0][0] <= min(c.seconds(lv) for lv in singles)

    def measured(lv):
        factor = 0.8 if tuple(lv) in singles else 1.0
        return (c.memory(lv), factor * c.seconds(lv))

    _measured(monkeypatch, {}, measured)
    layers = _layers(L)
    start = Plan(layers, ["keep"] * L, costs=c)
    got = start.replan(int(budget), step_fn=lambda: None, model=torch.nn.Sequential(*layers))
    assert c.memory(got.levers) <= budget
    best = min(measured(lv)[1] for lv in singles)
    assert measured(got.levers)[1] <= best


# ---- the runtime -------------------------------------------------------------------------


def test_selective_offload_inputs_sends_only_the_inputs_bitwise() -> None:
    """Every layer ``selective_offload_inputs``, the last included: each sends its
    input (one tensor of the residual stream's size) and nothing else (the kept
    outputs stay on the device), gets it back, and the gradients are bitwise those of
    the model without levers."""
    model = _ref_model()
    ref = copy.deepcopy(model)
    levers = ["selective_offload_inputs"] * 4
    p = Plan(model.layers, levers, min_tensor_bytes=0).apply(model)
    try:
        for _ in range(3):  # the first step of a selective layer learns what it keeps
            x = torch.randn(2, 32, 64)
            _assert_same(_step(ref, x), _step(model, x))
            stats = p.offloader.stats
            width = x.numel() * x.element_size()  # batch x seq x hidden, fp32
            assert [la.bytes_offloaded for la in stats.layers] == [width] * 4
            assert stats.bytes_reloaded == stats.bytes_offloaded
        # selective_offload sends the kept outputs too: more than the inputs
        both = Plan(model.layers, ["selective_offload"] * 3 + ["keep"], min_tensor_bytes=0)
    finally:
        p.remove()
    both.apply(model)
    try:
        x = torch.randn(2, 32, 64)
        _assert_same(_step(ref, x), _step(model, x))
        assert both.offloader.stats.layers[0].bytes_offloaded > width
    finally:
        both.remove()


@pytest.mark.parametrize("lever", ["checkpoint_offload", "selective_offload_inputs"])
def test_the_last_layer_input_leaves_before_the_head(lever: str) -> None:
    """The last layer's group is released at its close: its input's storage is free
    once the layers have run, before what follows them (the head, the loss); it comes
    back for the recompute, bitwise."""
    model = _ref_model()
    ref = copy.deepcopy(model)
    seen: list[StorageWeakRef] = []
    hook = model.layers[-1].register_forward_pre_hook(
        lambda _m, args: seen.append(StorageWeakRef(args[0].untyped_storage()))
    )
    p = Plan(model.layers, ["keep"] * 3 + [lever], min_tensor_bytes=0).apply()
    try:
        x = torch.randn(2, 32, 64)
        for _ in range(2):
            seen.clear()
            for q in model.parameters():
                q.grad = None
            with p:
                h = model(x)
                assert seen[0].expired()  # the head has not run: the input is gone
                layer = p.offloader.last_step.layers[-1]
                assert layer.planned and layer.released  # its device references dropped
            loss = h.float().square().mean()  # ReferenceModel.loss
            loss.backward()
            got = loss.detach(), [q.grad.clone() for q in model.parameters()]
            _assert_same(_step(ref, x), got)
            stats = p.offloader.stats
            assert stats.layers[-1].bytes_offloaded == x.numel() * x.element_size()
            assert stats.bytes_reloaded == stats.bytes_offloaded
    finally:
        p.remove()
        hook.remove()


def test_plan_measures_the_selective_step_for_the_input_lever(monkeypatch) -> None:
    """``offload.plan`` with only ``selective_offload_inputs`` allowed measures the
    every-layer selective step (its kept fraction and time are fitted to it) and no
    offload step (it sends only inputs, as ``checkpoint_offload`` does)."""
    inject_measurements(monkeypatch, [1000.0, 600.0] + [500.0] * 30)
    model = _ref_model()
    x = torch.randn(2, 32, 64)
    chosen = offload.plan(
        lambda: model.loss(x).backward(),
        model.layers,
        budget=0.7,
        model=model,
        levers=("selective_offload_inputs",),
        min_tensor_bytes=0,
        steps=1,
    )
    assert list(chosen.measured["configs"]) == ["none", "selective"]
    assert set(chosen.levers) <= {"selective_offload_inputs", "keep"}


def test_the_table_shows_what_no_lever_touches() -> None:
    from rich.console import Console

    from offload._core._units import format_bytes

    c = _llama_like()
    L = c.num_layers
    p = Plan(_layers(L), ["checkpoint_offload"] * L, costs=c)
    console = Console(record=True, width=120)
    console.print(p.table())
    text = console.export_text()
    head = next(line for line in text.splitlines() if "head" in line)
    assert format_bytes(c.head_bytes) in head and "no lever" in head
    assert "workspace" in text and format_bytes(c.workspace_bytes) in text
