"""The planner on a CUDA GPU: ``offload.plan`` measures a real step, the plan it picks
fits its budget in prediction, frees memory when applied, and trains bitwise like the
model without it (deterministic algorithms, a control run). Run with
``PYTHONPATH=. python3 -m pytest -m cuda tests/test_planner_cuda.py``."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts

import pytest  # noqa: E402
import torch  # noqa: E402

import offload  # noqa: E402
from offload._planner import _run  # noqa: E402
from offload._reference import ReferenceModel  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("cuda_deterministic"),
]


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
    """From a selective layer's second step on, the outputs its recompute never asked
    for (the down projection's) are not kept: under ``selective`` the step's peak drops
    by about one hidden-size tensor per selective layer (measured), under
    ``selective_offload`` that tensor no longer travels; gradients stay bitwise."""
    torch.manual_seed(0)
    L, hidden = 4, 1024
    model = ReferenceModel(L, hidden, 8, 2816, device="cuda", dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    plan = offload.Plan(model.layers, [lever] * (L - 1) + ["keep"], min_tensor_bytes=0)
    plan.apply(model)
    peaks, sent = [], []
    try:
        for _ in range(3):
            x = torch.randn(1, 2048, hidden, device="cuda", dtype=torch.bfloat16)
            want = _grads(ref, x)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            have = _grads(model, x)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
            assert torch.equal(want[0], have[0])
            assert all(torch.equal(a, b) for a, b in zip(want[1], have[1]))
            if lever == "selective_offload":
                stats = plan.offloader.stats
                assert stats.bytes_reloaded == stats.bytes_offloaded > 0
                sent.append(stats.bytes_offloaded)
    finally:
        plan.remove()
    down = x.numel() * x.element_size()  # one output of the down projection
    assert peaks[1] == peaks[2] <= peaks[0]
    if lever == "selective":
        saved = peaks[0] - peaks[1]
        assert (L - 1) * down * 0.9 <= saved <= (L - 1) * down * 1.1, (peaks, down)
    else:
        assert sent[0] - sent[1] == (L - 1) * down and sent[1] == sent[2], (sent, down)
