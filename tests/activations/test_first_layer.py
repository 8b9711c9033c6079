"""The step's first layer call places its saves at its close (offload/activations/_saves.py,
Note [release order], 1(c)), and the offloader prepares the next forward's Step when a
forward ends. Every test compares against the model without offloading with
``torch.equal`` and checks that the first layer really was offloaded."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import offload
from offload._core import _runtime
from offload._core._device import SyncBackend
from offload.activations._control import Internals
from offload.activations._handles import Kept, Offloaded, Pending
from offload.activations._step import LATE_CALLS, Step
from tests import models


class Probe(nn.Module):
    """A block that reports, after its first save, what the offloader's open group holds
    (``seen``), and optionally asks autograd for a gradient inside its own forward or
    changes a saved tensor in place."""

    def __init__(self, dim: int = 32, grad_inside: bool = False, inplace: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.off: offload.ActivationOffloader | None = None
        #: (group index, saves held back or -1, storages placed in the step so far)
        self.seen: list[tuple[int, int, int]] = []
        self.grad_inside = grad_inside
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(self.fc1(x))  # sin saves fc1's output
        step = self.off.last_step if self.off is not None else None
        if step is not None and step.in_progress and step.open_layer is not None:
            g = step.layers[step.open_layer]
            held = -1 if g.held_back is None else g.held_back
            self.seen.append((g.index, held, step.storages_placed))
        if self.grad_inside:
            # an unpack before the layer closes: the saved tensor is still the original
            (d,) = torch.autograd.grad(h.sum(), self.fc1.weight, retain_graph=True)
            h = h + 0 * d.sum()
        y = self.fc2(h)
        if self.inplace:
            h.mul_(2)  # h was saved by fc2 (its input): backward must refuse
        return y


def _layers(n: int = 3, **kw) -> nn.ModuleList:
    """``n`` Probe blocks; ``kw`` applies to the first one only."""
    torch.manual_seed(0)
    return nn.ModuleList(Probe(**(kw if i == 0 else {})) for i in range(n))


def test_first_layer_places_its_saves_at_its_close() -> None:
    layers = _layers()
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=[0, 1], min_tensor_bytes=0)
    for layer in layers:
        layer.off = off
    x = torch.randn(16, 32)
    for _ in range(2):  # the second step uses the Step prepared when the first ended
        got = models.step(layers, x, models.run_plain, off)
        models.assert_same(got, models.step(ref, x, models.run_plain))
        # group 0: its saves (input, weight view, fc1's output) held back, nothing
        # placed yet; group 1: placed at save time
        assert layers[0].seen[-1] == (0, 3, 0)
        index, held, placed = layers[1].seen[-1]
        assert (index, held) == (1, -1) and placed > 0
        stats = off.stats
        assert stats.layers[0].bytes_offloaded > 0  # placed at the close
        assert stats.layers[1].bytes_offloaded > 0
        assert stats.host_pool_bytes == 0


def test_only_an_offloaded_first_call_defers() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, offload_layers=[1], min_tensor_bytes=0)
    for layer in layers:
        layer.off = off
    got = models.step(layers, torch.randn(16, 32), models.run_plain, off)
    assert got[0].isfinite()
    index, held, placed = layers[1].seen[-1]
    assert (index, held) == (1, -1) and placed > 0
    assert off.stats.layers[1].bytes_offloaded > 0


def test_unpack_before_the_close_gets_the_original() -> None:
    layers = _layers(grad_inside=True)
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=[0, 1], min_tensor_bytes=0)
    x = torch.randn(16, 32)
    got = models.step(layers, x, models.run_plain, off)
    models.assert_same(got, models.step(ref, x, models.run_plain))
    assert off.stats.layers[0].bytes_offloaded > 0


def test_change_in_place_after_the_save_raises_like_autograd() -> None:
    layers = _layers(inplace=True)
    ref = models.twin(layers)
    x = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        models.step(ref, x, models.run_plain)
    off = offload.ActivationOffloader(layers, offload_layers=[0], min_tensor_bytes=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        models.step(layers, x, models.run_plain, off)
    assert off.stats.layers[0].bytes_offloaded > 0
    del plain


def test_kept_save_keeps_its_version_at_save_time() -> None:
    """A deferred save that stays on the device (below ``min_tensor_bytes``) is checked
    against its version at save time, not at the close."""
    layers = _layers(inplace=True)
    off = offload.ActivationOffloader(layers, offload_layers=[0], min_tensor_bytes=1 << 30)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        models.step(layers, torch.randn(16, 32), models.run_plain, off)
    assert off.stats.layers[0].bytes_kept["small"] > 0


def test_exception_in_the_first_layer_frees_everything() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, offload_layers=[0, 1], min_tensor_bytes=0)
    for layer in layers:
        layer.off = off

    def boom(module, args, output):
        raise ValueError("failure")

    h = layers[0].fc2.register_forward_hook(boom)
    with pytest.raises(ValueError, match="failure"):
        with off:
            models.run_plain(layers, torch.randn(16, 32))
    h.remove()
    index, held, placed = layers[0].seen[-1]
    assert index == 0 and held > 0 and placed == 0  # it failed with saves held back
    step = off.last_step
    assert step.aborted and all(g.held_back is None for g in step.layers)
    assert off.stats.host_pool_bytes == 0
    # the next step works and is exact
    for layer in layers:
        layer.off = None  # a twin copies no offloader
    ref = models.twin(layers)
    x = torch.randn(16, 32)
    got = models.step(layers, x, models.run_plain, off)
    models.assert_same(got, models.step(ref, x, models.run_plain))
    assert off.stats.layers[0].bytes_offloaded > 0


def test_deferred_handles_wrap_the_saved_tensor_until_the_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = _layers(n=2)
    off = offload.ActivationOffloader(layers, offload_layers=[0], min_tensor_bytes=0)
    handles: list[tuple[Pending, Kept]] = []
    original = Step.pack

    def pack(step, t):
        handle = original(step, t)
        if type(handle) is Pending and step.open is not None and step.open.index == 0:
            assert type(handle.inner) is Kept and handle.inner.tensor is not t
            handles.append((handle, handle.inner))
        return handle

    with monkeypatch.context() as m:  # the pack of the steps made meanwhile (this one)
        m.setattr(Step, "pack", pack)
        with off:
            loss = models.run_plain(layers, torch.randn(16, 32)).sum()
    assert len(handles) >= 2
    assert all(h.inner is not at_save for h, at_save in handles)  # placed at the close
    assert any(isinstance(h.inner, Offloaded) for h, _ in handles)
    loss.backward()
    assert off.stats.layers[0].bytes_offloaded > 0


def test_next_step_is_prepared_when_a_forward_ends() -> None:
    layers = _layers()
    off = offload.ActivationOffloader(layers, offload_layers=[0], min_tensor_bytes=0)
    inner = Internals(off)
    assert inner.next_step() is None
    with off:
        models.run_plain(layers, torch.randn(16, 32)).sum().backward()
    prepared = inner.next_step()
    assert prepared is not None and not prepared.groups
    with off:
        assert inner.current_step() is prepared and inner.next_step() is None
        models.run_plain(layers, torch.randn(16, 32)).sum().backward()
    with pytest.raises(ValueError):
        with off:
            raise ValueError("a failed forward prepares nothing")
    assert inner.next_step() is None
    off.close()
    assert inner.next_step() is None


def test_attached_layers_keep_their_hooks_between_forwards() -> None:
    """While attached, the layer hooks stay registered (not re-registered at every
    forward); removing the attachment takes them off."""
    layers = _layers()
    model = nn.Sequential(*layers)
    ref = models.twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=[0, 1], min_tensor_bytes=0)
    handle = off.attach(model)
    hooks = [dict(m._forward_pre_hooks) for m in layers]
    assert all(len(h) == 1 for h in hooks)
    x = torch.randn(16, 32)
    for _ in range(2):
        got = models.step(layers, x, lambda ls, v: model(v))
        models.assert_same(got, models.step(ref, x, models.run_plain))
        assert off.stats.layers[0].bytes_offloaded > 0
        assert [dict(m._forward_pre_hooks) for m in layers] == hooks  # the same hooks
    with torch.no_grad():  # outside a training forward they do nothing
        model(x)
    handle.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in layers)
    off.close()


class _Mark:
    def __init__(self, reached: bool) -> None:
        self.reached = reached

    def query(self) -> bool:
        return self.reached


class _ScriptedBackend(SyncBackend):
    """The synchronous backend posing as an asynchronous one whose device has reached
    the ``n``-th mark taken iff ``reached(n)``: the late placement of the first call's
    saves (Note [release order], 1(c)) decided on the CPU."""

    is_async = True

    def __init__(self, device: torch.device, reached: Callable[[int], bool]) -> None:
        super().__init__(device)
        self.reached = reached
        self.marks = 0

    def mark_ready(self) -> _Mark:
        self.marks += 1
        return _Mark(self.reached(self.marks))


@pytest.mark.parametrize(
    ("n", "k", "reached", "placed_at"),
    [
        (8, 1, lambda m: True, LATE_CALLS),  # the device keeps up: placed at the limit
        (8, 1, lambda m: m == 1, 2),  # short of the mark taken at the open of call 1
        (3, 1, lambda m: True, 1),  # released at call 2: placed a call before
        (8, 2, lambda m: True, None),  # the next call is offloaded: placed at the close
    ],
)
def test_first_layer_placed_once_the_host_is_a_call_ahead(
    n: int,
    k: int,
    reached: Callable[[int], bool],
    placed_at: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(n))
    ref = models.twin(layers)
    backend = _ScriptedBackend(torch.device("cpu"), reached)
    monkeypatch.setattr(_runtime, "backend_for", lambda d, _stream=None: backend)
    off = offload.ActivationOffloader(layers, offload_layers=k, min_tensor_bytes=0)
    for it in range(2):
        backend.marks = 0
        x = torch.randn(4, 32) + it
        got = models.step(layers, x, models.run_plain, off)
        models.assert_same(got, models.step(ref, x, models.run_plain))
        assert off.last_step.placed_late_at == placed_at
        assert off.stats.layers[0].bytes_offloaded > 0
    off.close()


# --------------------------------------------------------------------------------------
# Note [release order], 1(d): a copy of a call's own input waits only for a mark taken
# at the call's start


class _Block(nn.Module):
    """Linear, tanh, Linear; ``doubling``: doubles its input in place first (a new
    version of the tensor its first Linear saves)."""

    def __init__(self, dim: int, doubling: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.doubling = doubling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.doubling:
            x = x.mul_(2)
        return self.b(torch.tanh(self.a(x)))


class _ReadyBackend(SyncBackend):
    """The synchronous backend posing as an asynchronous one; records which mark each
    D2H copy waited for (``None``: everything queued so far)."""

    is_async = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.marks: list[object] = []
        self.copies: list[tuple[torch.Size, object]] = []

    def mark_ready(self) -> object:
        mark = object()
        self.marks.append(mark)
        return mark

    def d2h(self, pairs, fence, times=None, transient=None, ready=None) -> None:  # type: ignore[no-untyped-def]
        for src, _dst, _codec in pairs:
            self.copies.append((src.shape, ready))
        super().d2h(pairs, fence, times, transient, ready)


@pytest.mark.parametrize(
    ("lever", "recompute"),
    [("checkpoint_offload", "reentrant"), ("checkpoint_offload", "non_reentrant"), ("offload", "")],
)
def test_inputs_copied_after_the_calls_start(lever: str, recompute: str, monkeypatch) -> None:
    # Every call's input (the first Linear saves it) waits only for the mark of its
    # call's start; the tanh output (made in the call) waits for everything queued; so
    # does an input changed in place in the call (call 2 when offloaded: a recomputed
    # call may not change its inputs), and the first call's (1(c)). Small tensors would
    # travel in buckets (1(b)), whose flat copies are kernels on the compute stream.
    from offload.activations import _saves

    monkeypatch.setattr(_saves, "_GATHER_MAX_BYTES", 0)
    torch.manual_seed(0)
    dim, n = 32, 4
    doubling = 2 if lever == "offload" else -1
    layers = nn.ModuleList(_Block(dim, i == doubling) for i in range(n))
    ref = models.twin(layers)
    levers = [lever] * (n - 1) + ["keep"]
    plan = offload.Plan(
        list(layers), levers, min_tensor_bytes=0, recompute=recompute or "reentrant"
    )
    backend = _ReadyBackend(torch.device("cpu"))
    monkeypatch.setattr(_runtime, "backend_for", lambda d, _stream=None: backend)
    plan.apply()
    x = torch.randn(8, dim)
    got = models.step(layers, x, models.run_plain, plan.offloader)
    models.assert_same(got, models.step(ref, x, models.run_plain))
    plan.remove()
    early = [ready is not None and ready in backend.marks for _, ready in backend.copies]
    if lever == "checkpoint_offload":  # only the inputs travel: calls 0, 1, 2
        assert early == [False, True, True]
    else:  # the input and the tanh output of calls 0, 1 and 2
        assert early == [False, False, True, False, False, False]
