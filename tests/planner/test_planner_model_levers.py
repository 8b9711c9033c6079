"""The planner's model levers on the CPU (``offload/_planner/model_levers.py``): a tiny
Hugging Face Llama in fp32 whose injected peaks put most of the step in the head and
the loss; a budget below them is met only with the LM head and loss in slices, which
the plan takes, applies (loss and gradients within the tolerance of
docs/long-context.md) and removes (the model's forward as it was). The CUDA twin
measures the same on a GPU."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import offload
from offload._core import _levers
from offload._planner import fit as _fit
from offload._planner import verify as _verify
from offload._planner.levers import Recompute
from offload._planner.model_levers import head_model, variants
from tests.hf_tiny import FP32, batch, tiny_llama
from tests.planner.test_planner import inject_measurements

pytest.importorskip("transformers")

VOCAB = 512


def _head_on(model: torch.nn.Module) -> bool:
    return getattr(model.__dict__.get("forward"), "_offload_sliced_head", False)


def _recomputed(layers) -> bool:
    return any(isinstance(layer.__dict__.get("forward"), Recompute) for layer in layers)


def _injected(monkeypatch, model, layers, step) -> int:
    """Peaks that follow what is applied: the layers hold ``S`` (the bytes they save,
    counted) or a tenth of it recomputed, the head and the loss 3 ``S`` or 0.3 ``S`` in
    slices; a recompute costs 2 ms, the slices 0.5 ms over 10 ms. Returns ``S``."""
    inject_measurements(monkeypatch, [])
    saved = sum(_fit._saved_counts(step, layers, model, 0))

    def fake_run(step_fn, steps, warmup):
        for _ in range(steps + warmup):
            step_fn()
        layers_part = 0.1 * saved if _recomputed(layers) else saved
        head_part = 0.3 * saved if _head_on(model) else 3.0 * saved
        seconds = 0.01 + 0.002 * _recomputed(layers) + 0.0005 * _head_on(model)
        return {
            "seconds": seconds,
            "peak_bytes": layers_part + head_part,
            "times": [seconds] * steps,
        }

    monkeypatch.setattr(_verify, "measure_step", fake_run)
    return saved


def _grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_plan_takes_the_head_lever_when_the_budget_is_below_the_head(monkeypatch) -> None:
    model = tiny_llama(vocab=VOCAB)
    reference = copy.deepcopy(model)
    layers = offload.find_layers(model)
    ids, labels = batch(VOCAB)
    saved = _injected(monkeypatch, model, layers, lambda: model(ids, labels=labels).loss.backward())
    step = lambda: model(input_ids=ids, labels=labels).loss.backward()  # noqa: E731
    # without the head lever the floor is the head's 3 S: 0.6 S needs the slices
    with pytest.raises(ValueError, match="below the smallest feasible"):
        offload.plan(step, layers, budget=int(0.6 * saved), model=model, levers=["checkpoint"],
                     model_levers=(), steps=1, warmup=1, min_tensor_bytes=0)  # fmt: skip
    chosen = offload.plan(
        step, layers, budget=int(0.6 * saved), model=model, levers=["checkpoint"], steps=1, min_tensor_bytes=0,
        warmup=1,
    )  # fmt: skip
    assert chosen.model_levers == ("sliced_head",), chosen
    assert chosen.levers == ["checkpoint"] * len(layers)
    assert chosen.head_model is model
    # tiling was not a candidate: no MLP call of 37 tokens is longer than a tile
    why = chosen.measured["model_levers"]
    assert why["sliced_head"] == "" and "longer than a tile" in why["tiled_mlp"]
    assert "none + sliced_head" in chosen.measured["configs"]
    assert chosen.predicted_bytes <= chosen.budget_bytes
    assert chosen.to_dict()["equality"]["bitwise"] is False
    assert not _head_on(model) and not _recomputed(layers)  # every trial removed
    text = io.StringIO()
    from rich.console import Console

    chosen.report(Console(file=text, width=200))
    assert "sliced_head" in text.getvalue()
    assert "LM head and loss in slices (offload.sliced_head_loss)" in chosen.summary()
    # applied: loss and gradients within the stated tolerance of no lever
    want = _grads(reference, ids, labels)
    chosen.apply(model)
    try:
        assert _levers.head_lever_over(layers)
        have = _grads(model, ids, labels)
        assert model(input_ids=ids, labels=labels).logits is None
    finally:
        chosen.remove()
    torch.testing.assert_close(have[0], want[0], **FP32)
    for a, b in zip(have[1], want[1]):
        torch.testing.assert_close(a, b, **FP32)
    # removed: the model's forward, head and loss as they were, bitwise
    assert "forward" not in model.__dict__ and "_loss_function" not in model.__dict__
    assert "forward" not in model.get_output_embeddings().__dict__
    assert not any("forward" in layer.__dict__ for layer in layers)
    assert not _levers.head_lever_over(layers)
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        got, ref = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.loss, ref.loss)


def test_plan_takes_the_head_lever_only_where_the_budget_needs_it(monkeypatch) -> None:
    model = tiny_llama(vocab=VOCAB)
    layers = offload.find_layers(model)
    ids, labels = batch(VOCAB)
    step = lambda: model(input_ids=ids, labels=labels).loss.backward()  # noqa: E731
    saved = _injected(monkeypatch, model, layers, step)
    kw = dict(model=model, levers=["checkpoint"], steps=1, warmup=1, min_tensor_bytes=0)
    # the step without levers fits: nothing, no model lever (it would cost 0.5 ms)
    roomy = offload.plan(step, layers, budget=1.0, **kw)
    assert roomy.model_levers == () and roomy.levers == ["keep"] * len(layers)
    assert roomy.to_dict()["equality"] == {"bitwise": True}
    # 3.5 S: recomputing the layers (2 ms, bitwise) or slicing the head (0.5 ms, not
    # bitwise): the recompute, since a plan without model levers meets the budget
    exact = roomy.replan(int(3.5 * saved), step_fn=step, model=model)
    assert exact.model_levers == () and exact.levers == ["checkpoint"] * len(layers)
    assert exact.to_dict()["equality"] == {"bitwise": True}
    # 2 S: below the head's 3 S, which only the slices reach; the layers stay kept
    sliced = roomy.replan(int(2 * saved), step_fn=step, model=model)
    assert sliced.model_levers == ("sliced_head",) and sliced.levers == ["keep"] * len(layers)
    assert sliced.to_dict()["equality"]["bitwise"] is False


def test_the_head_lever_is_a_candidate_only_on_a_causal_lm_holding_the_layers() -> None:
    model = tiny_llama(vocab=VOCAB)
    layers = offload.find_layers(model)
    assert head_model(model, layers) == (model, "")
    other = tiny_llama(vocab=VOCAB, seed=1)
    causal, why = head_model(other, layers)
    assert causal is None and "does not hold the layers" in why
    causal, why = head_model(model.model, layers)  # the decoder alone: no head, no loss
    assert causal is None and "no Hugging Face causal LM" in why
    ref = offload.models.ReferenceModel(layers=2, hidden=32, heads=2, ffn=64)
    assert head_model(ref, ref.layers)[0] is None
    assert variants(["tiled_mlp", "sliced_head"]) == [
        (), ("sliced_head",), ("tiled_mlp",), ("sliced_head", "tiled_mlp"),
    ]  # fmt: skip


def test_a_plan_by_hand_with_model_levers_applies_and_removes() -> None:
    model = tiny_llama(vocab=VOCAB)
    reference = copy.deepcopy(model)
    layers = offload.find_layers(model)
    ids, labels = batch(VOCAB, seq=64)
    want = _grads(reference, ids, labels)
    plan = offload.Plan(
        layers, ["checkpoint_offload", "checkpoint"], model_levers=["sliced_head", "tiled_mlp"],
        head_model=model, slice_tokens=16, tile_tokens=16, min_tensor_bytes=0,
    )  # fmt: skip
    assert repr(plan) == "Plan(1 checkpoint, 1 checkpoint_offload; sliced_head, tiled_mlp)"
    plan.apply(model)
    try:
        have = _grads(model, ids, labels)
        assert plan._model_set is not None and plan._model_set.calls()["tiled_mlp"] > 0
    finally:
        plan.remove()
    torch.testing.assert_close(have[0], want[0], **FP32)
    for a, b in zip(have[1], want[1]):
        torch.testing.assert_close(a, b, **FP32)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="selective levers keep every tile"):
        offload.Plan(layers, ["selective", "keep"], model_levers=["tiled_mlp"])
    with pytest.raises(ValueError, match="head_model is None"):
        offload.Plan(layers, ["keep", "keep"], model_levers=["sliced_head"])
    with pytest.raises(ValueError, match="unknown model lever"):
        offload.Plan(layers, ["keep", "keep"], model_levers=["fused"])


def test_cli_plan_model_levers_flag(capsys) -> None:
    from offload.cli import main

    assert main(["plan", "--budget", "0.5", "--model-levers", "sliced_head,fused"]) == 2
    assert "--model-levers: unknown ['fused']" in capsys.readouterr().err
