"""WeightOffloader on layers compiled one by one, both forms: ``layer.compile()`` (which
compiles ``_call_impl``, hooks included) and ``torch.compile(layer)``. The offloader's
hooks are eager boundaries, so each layer compiles its own body and the weights still
come and go around it: outputs and gradients bitwise equal to the same compiled model
without offloading (CPU ``aot_eager``; on the GPU inductor, deterministic algorithms)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import offload
from tests import models

DIM, HEADS, FFN = 32, 4, 64
FORMS = ["module.compile", "torch.compile"]


def llama(n: int, device: str, dtype: torch.dtype, frozen: bool) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(DIM, HEADS, FFN) for _ in range(n))
    return layers.to(device, dtype).requires_grad_(not frozen)


def compiled_calls(layers: nn.ModuleList, form: str, backend: str) -> list:
    if form == "module.compile":
        for layer in layers:
            layer.compile(backend=backend)
        return list(layers)
    return [torch.compile(layer, backend=backend) for layer in layers]


def breaks_not_at_eager_boundaries() -> set[str]:
    """Graph-break reasons so far, without the skip of a ``torch.compiler.disable``d
    function (the boundary itself, which some torch versions count as a break)."""
    return {r for r in counters["graph_break"] if "disable" not in r}


def weight_grads(layers: nn.ModuleList, off: offload.WeightOffloader | None) -> list:
    """This step's weight gradients in fp32 (with ``grads="host"``: the host ``main_grad``,
    an fp32 copy of the gradient), cleared for the next step."""
    if off is not None and off.grads == "host":
        got = [t.grad.clone() for t in off.host_parameters()]
        for t in off.host_parameters():
            t.grad = None  # the next backward writes main_grad afresh
        return got
    got = [p.grad.float() for p in layers.parameters() if p.requires_grad]
    for p in layers.parameters():
        p.grad = None
    return got


def train(
    form: str,
    backend: str,
    device: str,
    dtype: torch.dtype,
    frozen: bool,
    grads: str | None,
    steps: int = 3,
) -> tuple[list[torch.Tensor], set[str]]:
    """Outputs, input gradients and weight gradients of ``steps`` forward + backward
    passes, and the graph breaks they caused. ``grads=None``: no WeightOffloader."""
    torch._dynamo.reset()
    counters.clear()
    layers = llama(4, device, dtype, frozen)
    calls = compiled_calls(layers, form, backend)
    off = None if grads is None else offload.WeightOffloader(layers, grads=grads)
    g = torch.Generator(device=device).manual_seed(1)
    got = []
    for _ in range(steps):
        x = torch.randn(2, 16, DIM, device=device, dtype=dtype, generator=g)
        x.requires_grad_(True)
        y = x
        for call in calls:
            y = call(y)
        y.float().square().mean().backward()
        got += [y.detach(), x.grad, *weight_grads(layers, off)]
    if off is not None:
        # something was offloaded: every weight left the device and came back for each
        # forward and each backward (but the last layer's, kept from its forward)
        assert all(p.untyped_storage().nbytes() == 0 for p in layers.parameters())
        assert off.refills == steps * (2 * len(layers) - 1)
        off.close()
    breaks = breaks_not_at_eager_boundaries()
    torch._dynamo.reset()
    return got, breaks


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and got
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.float().cpu(), b.float().cpu()), f"tensor {i} differs"


def check(form: str, backend: str, device: str, dtype, frozen: bool, grads: str) -> None:
    want, ref_breaks = train(form, backend, device, dtype, frozen, None)
    got, breaks = train(form, backend, device, dtype, frozen, grads)
    assert_bitwise(got, want)
    # dynamo never traced into the offloader's hooks: they add no graph break of their own
    assert breaks <= ref_breaks, breaks - ref_breaks


CASES = [(True, "device"), (False, "device"), (False, "host")]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("frozen", "grads"), CASES)
def test_per_layer_compile_bitwise(form: str, frozen: bool, grads: str) -> None:
    check(form, "aot_eager", "cpu", torch.float32, frozen, grads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("cuda_deterministic")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("frozen", "grads"), CASES)
def test_per_layer_compile_inductor_cuda(form: str, frozen: bool, grads: str) -> None:
    check(form, "inductor", "cuda", torch.bfloat16, frozen, grads)


@pytest.mark.parametrize("form", FORMS)
def test_offloader_made_after_plain_compiled_steps(form: str) -> None:
    """Plain steps of the compiled layers first (a warm-up, an evaluation), the
    WeightOffloader made afterwards: its hooks never become frames for dynamo, and the
    steps stay bitwise equal to the same compiled layers without it."""

    def run(offloaded: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        layers = llama(3, "cpu", torch.float32, False)
        calls = compiled_calls(layers, form, "aot_eager")
        g = torch.Generator().manual_seed(1)
        got, off = [], None
        for i in range(3):
            if i == 1 and offloaded:
                off = offload.WeightOffloader(layers)
            x = torch.randn(2, 16, DIM, generator=g).requires_grad_(True)
            y = x
            for call in calls:
                y = call(y)
            y.float().square().mean().backward()
            got += [y.detach(), x.grad, *weight_grads(layers, off)]
        if off is not None:
            assert off.refills == 2 * (2 * len(layers) - 1)  # something was offloaded
            off.close()
        return got

    assert_bitwise(run(True), run(False))
