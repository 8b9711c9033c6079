"""The planner on a CUDA GPU: ``offload.plan`` measures a real step, the plan it picks
fits its budget in prediction, frees memory when applied, and trains bitwise like the
model without it (deterministic algorithms, a control run). Run with
``PYTHONPATH=. python3 -m pytest -m cuda tests/test_planner_cuda.py``."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload._planner.verify import measure_step as _run
from offload.models import ReferenceModel
from tests.models import ON_CUDA_DETERMINISTIC

pytestmark = ON_CUDA_DETERMINISTIC


def _grads(model, x):
    for p in model.parameters():
        p.grad = None
    loss = model.loss(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("fraction", [0.6, 0.45])
def test_plan_measures_fits_and_trains_bitwise(fraction: float) -> None:
    torch.manual_seed(0)
    model = ReferenceModel(6, 1024, 8, 2816, device="cuda", dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    x = torch.randn(1, 2048, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        model.loss(x).backward()

    plan = offload.plan(step, model.layers, budget=fraction, model=model, steps=2)
    base = plan.costs.activation_bytes
    assert plan.predicted_bytes <= plan.budget_bytes == pytest.approx(fraction * base)
    assert set(plan.levers) != {"keep"}
    free = _run(step, 2, 1)
    plan.apply(model)
    try:
        got = _run(step, 2, 1)
        assert got["peak_bytes"] < free["peak_bytes"]
        for _ in range(2):
            x2 = torch.randn_like(x)
            want = _grads(ref, x2)
            assert all(torch.equal(a, b) for a, b in zip(_grads(ref, x2)[1], want[1]))  # control
            have = _grads(model, x2)
            assert torch.equal(want[0], have[0])
            assert all(torch.equal(a, b) for a, b in zip(want[1], have[1]))
        if "offload" in plan.levers:
            assert plan.offloader.stats.bytes_offloaded > 0
    finally:
        plan.remove()
    print(
        plan.summary(),
        f"measured peak {got['peak_bytes'] / 2**30:.3f} GiB, {got['seconds'] * 1e3:.1f} ms",
    )


def test_infeasible_budget_is_a_clear_error() -> None:
    torch.manual_seed(0)
    model = ReferenceModel(3, 512, 4, 1408, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1024, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="smallest feasible"):
        offload.plan(lambda: model.loss(x).backward(), model.layers, budget=1024, model=model)


@pytest.mark.parametrize("lever", ["selective", "selective_offload"])
def test_selective_stops_keeping_what_the_recompute_never_uses(lever: str) -> None:
    """A selective layer learns on its first step which kept outputs its recompute never
    asks for (the down projection's) and stops keeping them: measured on two fresh
    plans' first steps, one learning and one starting from what the first learnt (as
    plans made by ``offload.plan`` do), the peak drops by one hidden-size tensor per
    selective layer under ``selective``, and that tensor no longer travels under
    ``selective_offload``; gradients stay bitwise."""
    from offload._planner.levers import KeptKeys as _Kept

    torch.manual_seed(0)
    L, hidden = 4, 1024
    model = ReferenceModel(L, hidden, 8, 2816, device="cuda", dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    levers = [lever] * (L - 1) + ["keep"]

    def first_step(learnt: list) -> tuple[int, int]:
        plan = offload.Plan(model.layers, levers, min_tensor_bytes=0)
        plan._learnt = learnt
        plan.apply(model)
        try:
            x = torch.randn(1, 2048, hidden, device="cuda", dtype=torch.bfloat16)
            want = _grads(ref, x)
            for p in model.parameters():
                p.grad = None  # before measuring: gradients freed inside would hide a peak
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = model.loss(x)
            loss.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
            have = (loss.detach(), [p.grad for p in model.parameters()])
            assert torch.equal(want[0], have[0])
            assert all(torch.equal(a, b) for a, b in zip(want[1], have[1]))
            sent = 0
            if plan.offloader is not None:
                stats = plan.offloader.stats
                assert stats.bytes_reloaded == stats.bytes_offloaded > 0
                sent = stats.bytes_offloaded
        finally:
            plan.remove()
        return peak, sent

    first_step([_Kept() for _ in range(L)])  # warm-up: one-time allocations
    learnt = [_Kept() for _ in range(L)]
    full = first_step(learnt)  # keeps every output, learns
    assert all(k.unused for k in learnt[: L - 1])
    lean = first_step(learnt)  # starts from what it learnt
    down = 2048 * hidden * 2  # one output of the down projection, bf16
    if lever == "selective":
        # the peak falls by the outputs kept at its moment: at least one layer's, at most
        # every selective layer's (and the allocator's rounding)
        assert down <= full[0] - lean[0] <= (L - 1) * down * 1.25, (full, lean, down)
    else:
        assert full[1] - lean[1] == (L - 1) * down, (full, lean, down)
        assert lean[0] <= full[0]


def test_memory_moments_account_for_the_step_without_levers() -> None:
    """The planner reads the allocator's peak at every layer boundary: the workspace of
    the layers and that of the head (here the loss) come out apart, and the model's raw
    peak without levers, built from them, is the peak measured without levers (the
    same step, measured twice), within the allocator's rounding."""
    torch.manual_seed(0)
    model = ReferenceModel(4, 1024, 8, 2816, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    base = offload.plan(
        lambda: model.loss(x).backward(), model.layers, budget=1.0, model=model, verify=False
    )
    c = base.costs
    assert c.head_bytes is not None and c.workspace_bytes > 0
    keep = ["keep"] * c.num_layers
    assert c.raw_memory(keep) == pytest.approx(c.activation_bytes, rel=0.05)


def test_cli_plan_on_an_hf_config(tmp_path, capsys) -> None:
    """``offload plan --hf-config`` end to end: measures, plans, prints the plan and how
    far its predictions were from what it measured."""
    transformers = pytest.importorskip("transformers")
    from offload import cli

    cfg = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
    )
    cfg.save_pretrained(tmp_path)
    argv = ["plan", "--hf-config", str(tmp_path), "--budget", "0.5", "--seq", "1024"]
    assert cli.main([*argv, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "offload plan" in out and "the cost model against the steps measured" in out


def test_every_layer_checkpoint_offload_meets_hf_checkpointing_with_offloaded_inputs() -> None:
    """A Hugging Face Llama whose head and loss hold the step's peak: every layer
    ``checkpoint_offload`` (the last one included: its input leaves before the head)
    peaks no higher than Hugging Face checkpointing with ``offload_checkpointing()``,
    and lower than the same plan with the last layer's input kept; gradients bitwise;
    and ``offload.plan`` finds a plan for that peak."""
    transformers = pytest.importorskip("transformers")
    from offload.integrations.hf import offload_checkpointing

    cfg = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda")
    layers = offload.find_layers(model)
    L = len(layers)
    width = 2048 * cfg.hidden_size * 2  # one layer's input, bf16

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def grads(m):
        for p in m.parameters():
            p.grad = None
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    handle = offload_checkpointing(model)
    try:
        hf = _run(step, 2, 2)["peak_bytes"]
    finally:
        handle.remove()
        model.gradient_checkpointing_disable()
    peaks = {}
    for name, levers in (
        ("all", ["checkpoint_offload"] * L),
        ("last kept", ["checkpoint_offload"] * (L - 1) + ["checkpoint"]),
    ):
        plan = offload.Plan(layers, levers).apply(model)
        try:
            peaks[name] = _run(step, 2, 2)["peak_bytes"]
            want, have = grads(ref), grads(model)
            assert torch.equal(want[0], have[0])
            assert all(torch.equal(a, b) for a, b in zip(want[1], have[1]))
            assert plan.offloader.stats.layers[-1].bytes_offloaded == (
                width if name == "all" else 0
            )
        finally:
            plan.remove()
    print(
        f"peaks MiB: hf {hf / 2**20:.1f}, "
        + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in peaks.items())
    )
    assert peaks["all"] <= hf + (1 << 20)  # the allocator's rounding
    assert peaks["all"] <= peaks["last kept"] - width // 2
    # the model's floor is every layer checkpoint_offload, within its error (a few
    # percent) of Hugging Face's measured peak, and a plan measured within that fits
    base = offload.plan(step, layers, budget=1.0, model=model, verify=False)
    assert base.costs.memory(["checkpoint_offload"] * L) <= 1.02 * hf
    chosen = base.replan(int(1.02 * hf), step_fn=step, model=model)
    assert any(ch["fits"] for ch in chosen.measured["checks"])
