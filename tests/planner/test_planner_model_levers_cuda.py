"""The planner's model levers on a CUDA GPU: a Hugging Face Llama whose LM head and loss
(a 32,000 vocabulary in fp32) hold most of the step; a budget below what they hold is
met only with the head in slices, which ``offload.plan`` measures, takes, verifies and
applies with gradients within the tolerance of docs/long-context.md (Note [equality of
the levers] in ``offload/_planner/verify.py``). Run with
``PYTHONPATH=. python3 -m pytest -m cuda tests/planner/test_planner_model_levers_cuda.py``."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload._planner.verify import measure_step
from tests.hf_tiny import BF16_REL, FP32, tiny_llama

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 32000


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_below_the_head_takes_the_head_lever_on_cuda(dtype: torch.dtype) -> None:
    pytest.importorskip("transformers")
    model = tiny_llama(
        vocab=VOCAB, hidden=256, ffn=704, layers=4, dtype=dtype, device="cuda", attn="sdpa"
    )
    reference = copy.deepcopy(model)
    layers = offload.find_layers(model)
    ids = torch.randint(0, VOCAB, (1, 4096), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    base = offload.plan(
        step, layers, budget=1.0, model=model, steps=2, verify=False, slice_tokens=512
    )  # "auto" would slice 4096 rows of a 32,000 vocab: the whole sequence here
    head = base.costs.head_bytes
    assert head is not None and head > 2 * sum(base.costs.saved_bytes) / len(layers)
    # below the head's own bytes (only the slices reach it) and above one layer's
    # recompute working set, which no lever cuts (in fp32 SDPA's math backend holds
    # about a GiB of attention scores at 4096 tokens)
    budget = int(0.9 * head)
    chosen = base.replan(budget, step_fn=step, model=model)
    assert "sliced_head" in chosen.model_levers, chosen.summary()
    assert chosen.predicted_bytes <= budget
    chosen.apply(model)
    try:
        got = measure_step(step, 3, 2)
        have = _grads(model, ids)
    finally:
        chosen.remove()
    assert got["peak_bytes"] <= budget, (got, chosen.summary())
    want = _grads(reference, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(have[0], want[0], **FP32)
        for a, b in zip(have[1], want[1]):
            torch.testing.assert_close(a, b, **FP32)
    else:
        for a, b in zip(have[1], want[1]):
            assert (a.float() - b.float()).abs().max() <= BF16_REL * b.float().abs().max()
    assert not any("forward" in m.__dict__ for m in model.modules())
