"""What offloaded calls hold on the device, on the CPU path: the release rule's bound
with a link slower than the forward, and calls run recomputed when host memory cannot
hold their saves (Note [recomputed calls] in
offload/activations/_recompute_calls.py). For "all",
an int and "auto", every step's loss and gradients are bitwise equal to the same model
without offloading; the calls past the host budget run recomputed with their inputs
offloaded instead of keeping their saves on the device, one warning names the setting,
and the modules are left as they were."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offload
from offload._core import _runtime
from offload._core._device import SyncBackend
from tests import models
from tests.models import assert_same, check_released, step, twin

L, SEQ, DIM = 6, 32, 64


def _layers() -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(DIM) for _ in range(L))
    return layers, twin(layers)


def _call_bytes() -> int:
    """The bytes one offloaded call sends, unconstrained."""
    layers, _ = _layers()
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    step(layers, torch.randn(2, SEQ, DIM), models.run_plain, off)
    off.close()
    return max(la.bytes_offloaded for la in off.stats.layers)


@pytest.mark.parametrize("selection", ["all", 4, "auto"])
def test_calls_past_the_host_budget_run_recomputed_bitwise(selection) -> None:
    per_call = _call_bytes()
    limit = int(2.5 * per_call)  # two calls fit, the third does not
    layers, ref = _layers()
    off = offload.ActivationOffloader(
        layers, offload_layers=selection, min_tensor_bytes=0, host_memory_limit=limit
    )
    planned = L - 1 if selection in ("all", "auto") else selection
    caught = []
    for it in range(3):
        x = torch.randn(2, SEQ, DIM)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = step(layers, x, models.run_plain, off)
        caught += [str(m.message) for m in w if "host_memory_limit" in str(m.message)]
        assert_same(got, step(ref, x, models.run_plain))
        stats = off.stats
        recomputed = [la.index for la in stats.layers if la.recomputed]
        plain = [la.index for la in stats.layers if la.offloaded and not la.recomputed]
        # the first calls fill the budget; every later planned call is recomputed
        assert plain == [0, 1], (it, plain, recomputed)
        assert recomputed == list(range(2, planned)), (it, recomputed)
        assert stats.bytes_offloaded > 2 * per_call  # the recomputed calls' inputs too
        assert stats.bytes_kept["host_limit"] == 0  # nothing kept for want of host room
        assert all(0 < stats.layers[i].bytes_offloaded < per_call for i in recomputed)
        assert "recomputed" in stats.summary()
    assert len(caught) == 1 and "raise host_memory_limit" in caught[0].lower()
    off.close()
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_recomputed_calls_free_their_saves_and_run_plain_outside_the_context() -> None:
    per_call = _call_bytes()
    layers, ref = _layers()
    off = offload.ActivationOffloader(
        layers, offload_layers="all", min_tensor_bytes=0, host_memory_limit=int(2.5 * per_call)
    )
    x = torch.randn(2, SEQ, DIM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(
            layers,
            x,
            models.run_plain,
            off,
            after_forward=lambda: check_released(layers, range(L - 1)),
        )
    # outside the context the wrapped layers save their intermediates as usual
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        layers[L - 2](x.clone().requires_grad_(True))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(2) or t, lambda t: t):
        ref[L - 2](x.clone().requires_grad_(True))
    assert saved.count(1) == saved.count(2) > 2
    off.close()


def test_a_budget_that_holds_every_call_recomputes_nothing() -> None:
    layers, ref = _layers()
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    for _ in range(2):
        x = torch.randn(2, SEQ, DIM)
        assert_same(step(layers, x, models.run_plain, off), step(ref, x, models.run_plain))
        assert not any(la.recomputed for la in off.stats.layers)
    assert all("forward" not in layer.__dict__ for layer in layers)
    off.close()


# ---- the bound on what offloaded calls hold on the device, with a slow link -----------


class _Pending:
    """An event of a link that has not got there yet (and never does while asked)."""

    def query(self) -> bool:
        return False


class _SlowLink(SyncBackend):
    """The synchronous backend posing as an asynchronous one whose copies are still in
    flight whenever asked: the forward outruns the link. Every wait of a stream on a
    copy's event is recorded: the compute waits for the link, memory does not grow."""

    is_async = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.waits = 0

    def mark_ready(self) -> _Pending:
        return _Pending()

    def record_d2h(self) -> _Pending:
        return _Pending()

    def wait(self, stream, event, times=None) -> None:
        if event is not None:
            self.waits += 1


@pytest.mark.parametrize("selection", ["all", 3, "auto"])
def test_offloaded_calls_hold_at_most_the_release_rules_bound_with_a_slow_link(
    selection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Note [release order], 3: with k of L calls offloaded, at most L - k calls hold
    # their saves on the device at the end of any call, however far the link lags
    layers, ref = _layers()
    link = _SlowLink(torch.device("cpu"))
    monkeypatch.setattr(_runtime, "backend_for", lambda d, _stream=None: link)
    off = offload.ActivationOffloader(layers, offload_layers=selection, min_tensor_bytes=0)
    k = L - 1 if selection in ("all", "auto") else selection
    live: list[int] = []

    def count(module, args, output) -> None:
        live.append(sum(1 for m in layers if m.probe is not None and not m.probe.expired()))

    hooks = [m.register_forward_hook(count) for m in layers]
    for _ in range(2):
        live.clear()
        for m in layers:
            m.probe = None
        x = torch.randn(2, SEQ, DIM)
        assert_same(step(layers, x, models.run_plain, off), step(ref, x, models.run_plain))
        assert len(live) == L and max(live) <= L - k, live
        assert off.stats.bytes_offloaded > 0
    assert link.waits >= k  # each release waited on its copy instead of dropping early
    for h in hooks:
        h.remove()
    off.close()


def test_the_release_rule_counts_only_calls_that_are_not_recomputed() -> None:
    from offload.activations._schedule import make_plan

    # one call offloaded, five recomputed: the offloaded one is released and reloaded as
    # if it were the only one (k = 1); each recomputed call's inputs leave at the next
    # call and come back one call ahead of its backward
    plan = make_plan(6, range(6), None, recomputed=range(1, 6))
    assert plan.recomputed == frozenset(range(1, 6))
    released = {g: r for r, gs in plan.release_at.items() for g in gs}
    reloaded = {g: q for q, gs in plan.reload_at.items() for g in gs}
    assert released == {0: 5, 1: 2, 2: 3, 3: 4, 4: 5}  # 5: at its own close
    assert reloaded == {0: 4, 1: 2, 2: 3, 3: 4, 4: 5, 5: 5}
    assert make_plan(6, range(1), None).release_at == {5: (0,)}
