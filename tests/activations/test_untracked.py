"""A forward that offloads nothing tracks its first layer call only (Note [untracked
calls] in ``offload/activations/_layer_calls.py``): ``offload_layers=0``, and "auto" choosing no
layer. Gradients stay bitwise equal to no offloading; the stats still list every call;
a step that must offload after all hooks every layer again."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offload
from offload.activations._auto._predict import LayerCost
from offload.activations._control import Internals
from tests import models
from tests.auto_fake import AUTO, FakeMemory, FakeMeter, one_thread  # noqa: F401
from tests.models import assert_same, step, twin

pytestmark = pytest.mark.usefixtures("one_thread")

_TOP = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _model(n_layers: int, dim: int = 64):
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(dim) for _ in range(n_layers))
    return layers, twin(layers)


def _untracked(L: int, warm: bool = True):
    """Layers, their twin and an offloader that offloads nothing; ``warm``: after one
    step (the plan knows the calls)."""
    layers, ref = _model(L)
    off = offload.ActivationOffloader(layers, offload_layers=0, min_tensor_bytes=0)
    if warm:
        _run(layers, ref, off)
    return layers, ref, off


def _hooked(layers) -> list[bool]:
    """Which layers carry a forward pre-hook now."""
    return [bool(layer._forward_pre_hooks) for layer in layers]


def _run(layers, ref, off, seq: int = 16, dim: int = 64) -> list[bool]:
    """One step under ``off`` (bitwise equal to ``ref`` without offloading); returns
    which layers were hooked at the end of the forward."""
    seen: list[bool] = []
    x = torch.randn(2, seq, dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "nothing was called" or other warning
        got = step(layers, x, _recording(seen), off)
    assert_same(got, step(ref, x, models.run_plain))
    assert not any(_hooked(layers)), "hooks left on the layers after the forward"
    return seen


def _recording(seen: list[bool]):
    def run(layers, x):
        y = models.run_plain(layers, x)
        seen[:] = _hooked(layers)
        return y

    return run


def test_offload_layers_zero_hooks_only_the_first_layer() -> None:
    L = 5
    layers, ref, off = _untracked(L, warm=False)
    for _ in range(3):
        hooked = _run(layers, ref, off)
        assert hooked == [True] + [False] * (L - 1)
        stats = off.stats
        assert [la.index for la in stats.layers] == list(range(L))
        assert not any(la.offloaded for la in stats.layers)
        assert stats.bytes_offloaded == 0
    assert not off.last_step.in_progress
    assert _TOP is None or _TOP(False) is None  # our saved-tensor hooks are off
    off.close()


def test_two_forwards_in_one_entry_each_get_every_call() -> None:
    # micro-batches inside one `with`: the first layer called again starts the next
    # forward, though the other layers carry no hook
    L = 4
    layers, ref, off = _untracked(L)  # after one step: the plan knows the calls
    x1, x2 = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    with off:
        l1 = models.run_plain(layers, x1.clone().requires_grad_(True)).square().mean()
        l2 = models.run_plain(layers, x2.clone().requires_grad_(True)).square().mean()
    (l1 + l2).backward()
    grads = [p.grad.clone() for p in layers.parameters()]
    r1 = models.run_plain(ref, x1.clone().requires_grad_(True)).square().mean()
    r2 = models.run_plain(ref, x2.clone().requires_grad_(True)).square().mean()
    (r1 + r2).backward()
    assert torch.equal(l1 + l2, r1 + r2)
    for g, p in zip(grads, ref.parameters()):
        assert torch.equal(g, p.grad)
    assert off._groups_this_entry == 2 * L
    assert len(off.stats.layers) == L
    off.close()


def test_attached_hooks_stay_on_every_layer_and_the_calls_are_listed() -> None:
    L = 4
    layers, ref, off = _untracked(L, warm=False)
    model = nn.Sequential(*layers)
    with off.attach(model):
        for _ in range(2):
            x = torch.randn(2, 16, 64)
            loss = model(x.clone().requires_grad_(True)).square().mean()
            assert all(_hooked(layers))
            loss.backward()
            grads = [p.grad.clone() for p in layers.parameters()]
            layers.zero_grad(set_to_none=True)
            ref_loss = models.run_plain(ref, x.clone().requires_grad_(True)).square().mean()
            ref_loss.backward()
            assert torch.equal(loss, ref_loss)
            for g, p in zip(grads, ref.parameters()):
                assert torch.equal(g, p.grad)
            ref.zero_grad(set_to_none=True)
            assert len(off.stats.layers) == L
            assert list(off.last_step.calls) == list(layers)
    assert not any(_hooked(layers))
    off.close()


def test_an_exception_in_an_untracked_call_leaves_nothing_behind() -> None:
    layers, ref, off = _untracked(4)

    def boom(module, args):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        h = layers[2].register_forward_pre_hook(boom)
        try:
            with off:
                models.run_plain(layers, torch.randn(2, 16, 64))
        finally:
            h.remove()
    assert not any(_hooked(layers))
    if _TOP is not None:
        assert _TOP(False) is None  # our saved-tensor hooks are not left on the stack
    _run(layers, ref, off)  # and the next step is fine
    off.close()


def test_a_forward_that_skips_the_expected_first_layer_is_left_alone() -> None:
    # the hooked first layer is not called (a layer-dropping forward): nothing happens,
    # no warning, and the next whole forward runs as before
    layers, ref, off = _untracked(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step(layers[1:], torch.randn(2, 16, 64), models.run_plain, off)
    assert got[0].isfinite()
    _run(layers, ref, off)
    off.close()


def test_auto_choosing_no_layer_runs_untracked_and_offloads_again_when_memory_needs() -> None:
    # The link hides no layer: "auto" settles on none, and its steps (the verifying ones
    # too) hook the first layer only. Then memory shrinks: the next step offloads what
    # memory needs, with every layer hooked again.
    L, need = 6, 3
    layers, ref = _model(L)
    off0 = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=1024)
    step(layers, torch.randn(2, 16, 64), models.run_plain, off0)
    freed = [la.bytes_released for la in off0.stats.layers]
    off0.close()
    base, act = 50 << 20, 3 * max(freed)
    memory = FakeMemory(1 << 40, base, lambda n: act, lambda n: freed)
    costs = [LayerCost(0.5e-3, 1e-3, 0)] * L
    meter = FakeMeter(lambda n: costs, freed[0] / 1.0, memory=memory)  # 1 s a layer
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    Internals(off).use_meter(meter)
    runs = []
    for _ in range(12):
        hooked = _run(layers, ref, off)
        runs.append((dict(off.stats.auto), hooked, off.stats.bytes_offloaded))
    assert runs[0][0]["step"] == "probe" and all(runs[0][1])  # measures every layer
    for i, (auto, hooked, sent) in enumerate(runs[2:], start=2):
        assert auto["offloaded"] == [] and sent == 0, auto
        # the decision's own reason, not "verifying ... in alternation with the choice"
        assert auto["step"] == "none" and "alternation" not in auto["reason"], auto
        # after a measuring forward, every layer is hooked at the next entry
        assert hooked == [True] + [False] * (L - 1) or i == 2, (i, hooked)
    # nothing to verify: settled once steps without offloading were timed
    assert runs[-1][0]["phase"] == "settled" and "nothing to verify" in runs[-1][0]["verification"]
    assert len(off.stats.layers) == L
    memory.limit = int((base + act + sum(freed[need : L - 1])) / (1 - AUTO.memory_margin))
    hooked = _run(layers, ref, off)
    auto = off.stats.auto
    # memory's need met by offloading, or (the link hides no layer) by recomputing the
    # calls past the link's choice with their inputs offloaded (Note [recomputed calls])
    met = len(auto["offloaded"]) + len(auto.get("recomputed", []))
    assert met >= need and auto["memory_reason"], auto
    assert off.stats.bytes_offloaded > 0
    assert all(hooked)
    off.close()
