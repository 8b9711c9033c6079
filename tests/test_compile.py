"""Layers compiled one by one (``torch.compile``, CPU ``aot_eager``) under the offloaders.

Both compile forms: ``layer.compile()`` compiles ``nn.Module._call_impl`` in place, hooks
included (torchtune's ``training.compile_model``, many Hugging Face recipes), and
``torch.compile(layer)`` returns an ``OptimizedModule`` wrapper whose hooks run outside
the compiled code (the offloader given the wrappers) or inside it (given the original
layers). Each run is compared with the same compiled layers run without offloading:
loss, every gradient and the input gradient ``torch.equal``, and something offloaded.
The offloader's code is an eager boundary (``offload/_core/_dynamo.py``): dynamo breaks its
graph at our hooks and compiles the layer's body in between. The GPU side (inductor,
deterministic algorithms) is ``tests/test_real_world_cuda.py``.
"""

from __future__ import annotations

import functools
import gc
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import offload
from offload._recompute._call import Record as _Record
from offload._recompute._call import _CallCopy as _HostCopy
from offload.activations._handles import Gathered, Offloaded
from tests import models
from tests.models import assert_same

FORMS = ["method", "wrapper", "wrapper_inner"]


def compiled_stack(
    form: str, n: int = 4, block: Callable[[], nn.Module] | None = None
) -> tuple[nn.ModuleList, list[nn.Module]]:
    """``n`` blocks compiled with ``aot_eager`` one by one: the stack the forward runs,
    and the modules the offloader is given (``wrapper_inner``: the original layers,
    whose hooks then run inside the compiled code)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    inner = [(block or functools.partial(models.LlamaBlock, 32, 2, 64))() for _ in range(n)]
    if form == "method":
        for layer in inner:
            layer.compile(backend="aot_eager")
        stack = nn.ModuleList(inner)
        return stack, list(stack)
    stack = nn.ModuleList(torch.compile(layer, backend="aot_eager") for layer in inner)
    return stack, (inner if form == "wrapper_inner" else list(stack))


def _breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


@pytest.mark.parametrize("form", FORMS)
def test_activation_offloader_on_compiled_layers_is_bitwise(form: str) -> None:
    stack, hooked = compiled_stack(form)
    off = offload.ActivationOffloader(hooked, offload_layers="all", min_tensor_bytes=0)
    counters.clear()
    for it in range(3):
        x = torch.randn(2, 8, 32) + it
        got = models.step(stack, x, models.run_plain, off)
        want = models.step(stack, x, models.run_plain)  # the same compiled layers
        assert_same(got, want)
        stats = off.stats
        assert [la.bytes_offloaded > 0 for la in stats.layers] == [True, True, True, False]
        assert stats.bytes_reloaded == stats.bytes_offloaded
    # dynamo broke its graphs only at the offloader's two layer hooks (run eagerly),
    # and only where they run inside the compiled code
    reasons = _breaks()
    if form == "wrapper":
        assert not reasons
    else:
        assert reasons and all("compiler.disable" in r for r in reasons), reasons
        assert any("_layer_start" in r for r in reasons)
        assert any("_layer_end" in r for r in reasons)
    off.close()


@pytest.mark.parametrize("form", ["method", "wrapper"])
def test_offload_checkpoint_of_compiled_layers_is_bitwise(form: str) -> None:
    stack, _ = compiled_stack(form)
    ckpt = offload.CheckpointOffloader(min_tensor_bytes=0)
    counters.clear()
    for it in range(2):
        x = torch.randn(2, 8, 32) + it
        got = models.step(stack, x, lambda ls, h: _checkpointed(ckpt, ls, h))
        want = models.step(stack, x, models.run_plain)
        assert_same(got, want)
        stats = ckpt.stats
        assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
        ckpt.reset_stats()
    assert not _breaks()
    ckpt.close()


def _checkpointed(ckpt: offload.CheckpointOffloader, layers: Any, x: torch.Tensor) -> Any:
    for layer in layers:
        x = ckpt.checkpoint(layer, x)
    return x


class SelfCheckpointing(nn.Module):
    """Checkpoints its own body, as Hugging Face's ``GradientCheckpointingLayer`` does:
    under ``layer.compile()`` the checkpoint call is traced with the layer."""

    def __init__(self, checkpoint: Callable[..., Any]) -> None:
        super().__init__()
        self.block = models.LlamaBlock(32, 2, 64)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpoint(self.block, x)


def test_offload_checkpoint_traced_inside_a_compiled_layer_warns_once() -> None:
    import offload._recompute._checkpoint as ck

    ckpt = offload.CheckpointOffloader(min_tensor_bytes=0)
    torch_ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    ck._traced_warned = False
    stack, _ = compiled_stack("method", 3, lambda: SelfCheckpointing(ckpt.checkpoint))
    ref, _ = compiled_stack("method", 3, lambda: SelfCheckpointing(torch_ckpt))
    counters.clear()
    x = torch.randn(2, 8, 32)
    with pytest.warns(UserWarning, match="torch.compile traces") as record:
        got = models.step(stack, x, models.run_plain)
    assert len([w for w in record if "torch.compile traces" in str(w.message)]) == 1
    assert record[0].filename == __file__  # the layer's forward, not our code
    want = models.step(ref, x, models.run_plain)
    assert_same(got, want)  # torch's checkpoint, compiled with the layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(models.step(stack, x, models.run_plain), want)
    # dynamo never traced the checks that it cannot (in_backward: a graph break)
    assert not any("graph_task" in r for r in _breaks()), _breaks()
    assert ckpt.stats.bytes_offloaded == 0


def test_hf_llama_decoder_layers_compiled_one_by_one() -> None:
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).train()
    layers = offload.find_layers(model)
    for layer in layers:
        layer.compile(backend="aot_eager")
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def run(entered: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if entered:
            with off:
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    for _ in range(2):
        got, want = run(True), run(False)
        assert torch.equal(got[0], want[0])
        assert len(got[1]) == len(want[1]) > 0
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert [la.bytes_offloaded > 0 for la in off.stats.layers] == [True, True, False]
    off.close()


def test_attached_offloader_under_a_compiled_model_is_bitwise() -> None:
    """The whole model compiled (``model.compile()``), the offloader attached to it: the
    attachment's hooks and the layers' run eagerly, between the compiled pieces."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*(models.LlamaBlock(32, 2, 64) for _ in range(3)))
    model.compile(backend="aot_eager")
    off = offload.ActivationOffloader(list(model), offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(2, 8, 32)

    def run() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        return models.step(model, x, lambda m, h: m(h))

    want = run()
    with pytest.warns(UserWarning, match="compiled as a whole"):  # not covered: it says so
        handle = off.attach(model)
    got = run()
    assert_same(got, want)
    assert off.stats.bytes_offloaded > 0
    handle.remove()
    off.close()


def test_a_handle_whose_constructor_never_ran_dies_quietly(monkeypatch) -> None:
    """A handle made but never initialised (dynamo tracing a pack that then fails makes
    such objects) must not raise in ``__del__``."""
    raised: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    for cls in (Offloaded, Gathered, _HostCopy, _Record):
        obj = cls.__new__(cls)
        del obj
        gc.collect()
    assert not raised, [r.exc_value for r in raised]


# ---- every order of plain and offloaded steps (issue 52, item 1) ------------------------

#: "P": a step of the compiled layers without offloading, "O": one with it
ORDERS = {"plain_first": "POO", "offloaded_first": "OPO", "alternating": "POPOP"}


def _mlp_stack(form: str) -> tuple[list[nn.Module], list[nn.Module]]:
    """Three ``Linear-GELU-Linear`` blocks compiled one by one (the calls the forward
    makes, and the modules the offloader is given: the same ones)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    inner = [nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(3)]
    if form == "method":
        for layer in inner:
            layer.compile(backend="aot_eager")
        return inner, inner
    calls = [torch.compile(layer, backend="aot_eager") for layer in inner]
    return calls, calls


def _orders(run_offloaded: Callable[..., Any], offloaded: Callable[[], int]) -> Any:
    """A test body: for each step of the order, the compiled layers with and without
    offloading give bitwise the same loss and gradients, and the offloaded step moved
    bytes to the host."""

    def body(form: str, order: str) -> None:
        calls, hooked = _mlp_stack(form)
        stack = nn.ModuleList(hooked)
        runner = run_offloaded(calls, hooked)
        for i, kind in enumerate(ORDERS[order]):
            x = torch.randn(4, 16, 128) + i
            want = models.step(stack, x, lambda _ls, h: _plain(calls, h))
            if kind == "O":
                assert_same(runner(stack, x), want)
                assert offloaded() > 0

    return body


def _plain(calls: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for call in calls:
        x = call(x)
    return x


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("form", ["method", "wrapper"])
def test_activation_offloader_in_every_order_of_plain_and_offloaded_steps(
    form: str, order: str
) -> None:
    offs: list[offload.ActivationOffloader] = []

    def make(calls: list[nn.Module], hooked: list[nn.Module]) -> Callable[..., Any]:
        off = offload.ActivationOffloader(hooked, offload_layers="all", min_tensor_bytes=0)
        offs.append(off)
        return lambda stack, x: models.step(stack, x, lambda _ls, h: _plain(calls, h), off)

    _orders(make, lambda: offs[0].stats.bytes_offloaded)(form, order)
    offs[0].close()


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("form", ["method", "wrapper"])
def test_offload_checkpoint_in_every_order_of_plain_and_offloaded_steps(
    form: str, order: str
) -> None:
    ckpt = offload.CheckpointOffloader(min_tensor_bytes=0)

    def make(calls: list[nn.Module], _hooked: list[nn.Module]) -> Callable[..., Any]:
        def run(stack: Any, x: torch.Tensor) -> Any:
            ckpt.reset_stats()
            return models.step(stack, x, lambda _ls, h: _checkpointed(ckpt, calls, h))

        return run

    _orders(make, lambda: ckpt.stats.bytes_offloaded)(form, order)
    ckpt.close()


def test_originals_of_wrappers_that_ran_plain_first_warn_naming_the_page() -> None:
    """``torch.compile(layer)`` run plain first, the offloader given the originals: the
    compiled code does not call hooks added later; the warning says what to pass."""
    calls, _ = _mlp_stack("wrapper")
    inner = [c._orig_mod for c in calls]
    x = torch.randn(4, 16, 128)
    _plain(calls, x).sum().backward()
    off = offload.ActivationOffloader(inner, offload_layers="all", min_tensor_bytes=0)
    with pytest.warns(UserWarning, match="give the offloader the wrappers.*docs/compile.md"):
        with off:
            y = _plain(calls, x)
    y.sum().backward()
    off.close()


@pytest.mark.parametrize("form", ["method", "wrapper", "attach_wrapper"])
def test_attached_offloader_on_a_model_compiled_whole_warns_once_naming_the_page(
    form: str,
) -> None:
    """Whole-model compile is not covered (it offloads less than eager): attaching to a
    compiled model, or compiling an attached one, says so once, naming docs/compile.md."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)))
    off = offload.ActivationOffloader(list(model), offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(4, 64)
    match = r"compiled as a whole.*docs/compile\.md"
    if form == "attach_wrapper":  # attached to the wrapper torch.compile returns
        call = torch.compile(model, backend="aot_eager")
        with pytest.warns(UserWarning, match=match):
            handle = off.attach(call)
    else:  # attached first, the model compiled afterwards
        handle = off.attach(model)
        if form == "method":
            model.compile(backend="aot_eager")
            call = model
        else:
            call = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            call(x).sum().backward()
    ours = [w for w in record if "compiled as a whole" in str(w.message)]
    assert len(ours) == (0 if form == "attach_wrapper" else 1), [str(w.message) for w in record]
    if ours:
        assert "docs/compile.md" in str(ours[0].message)
    handle.remove()
    off.close()
