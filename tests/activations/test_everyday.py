"""Regression tests of everyday use: nothing piles up across steps, the schedule does not
drift, misuse fails loudly, nothing is a silent no-op (CPU path)."""

from __future__ import annotations

import contextlib
import gc
import threading
import tracemalloc
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload
from offload.activations._control import Internals
from offload.activations._step import Step
from tests import models
from tests.models import assert_same, step, twin


def _live_steps() -> tuple[int, int]:
    """Steps alive: (used, prepared). After a finished step the offloader keeps the last
    forward's (its stats) and the one made at its end for the next forward; anything
    more is a leak."""
    gc.collect()
    steps = [o for o in gc.get_objects() if type(o) is Step]
    used = sum(1 for o in steps if o.groups or o.forward_done)
    return used, len(steps) - used


class SharedInputBlock(nn.Module):
    """A block that also takes a tensor passed to every layer (like a RoPE table)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * shared)


# ---- 1. hooks and Steps do not pile up --------------------------------------------------


def test_persistent_input_keeps_no_hooks_and_one_step() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    x = torch.randn(16, 32, requires_grad=True)
    for _ in range(100):
        h = x
        with off:
            for layer in layers:
                h = layer(h)
        h.square().mean().backward()
        assert not x._backward_hooks  # removed when the backward ended
    assert off.stats.bytes_offloaded > 0
    del h
    used, prepared = _live_steps()
    assert used <= 1 and prepared <= 1, (used, prepared)


def test_thousand_steps_flat_hooks_steps_heap() -> None:
    """A parameter passed to every layer and a caller-held input: hooks, live Steps
    and the Python heap stay flat over 1,000 steps."""
    torch.manual_seed(0)
    layers = nn.ModuleList(SharedInputBlock() for _ in range(4))
    shared = nn.Parameter(torch.rand(32))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    x = torch.randn(8, 32, requires_grad=True)

    def one() -> None:
        h = x
        with off:
            for layer in layers:
                h = layer(h, shared)
        h.square().mean().backward()

    for _ in range(50):
        one()
    gc.collect()
    tracemalloc.start()  # slows every step down: traced over 200 of the 1,000 steps
    try:
        for _ in range(50):
            one()
        gc.collect()
        early, _ = tracemalloc.get_traced_memory()
        for _ in range(200):
            one()
        gc.collect()
        late, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert late - early < 32 * 1024, (early, late)  # a Step per step would be far more
    for _ in range(700):
        one()
        assert not x._backward_hooks and not shared._backward_hooks
    assert off.stats.bytes_offloaded > 0
    used, prepared = _live_steps()
    assert used <= 1 and prepared <= 1, (used, prepared)


def test_hooks_of_a_step_without_backward_go_at_next_forward() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    x = torch.randn(4, 32, requires_grad=True)
    for _ in range(5):
        h = x
        with off:
            for layer in layers:
                h = layer(h)
        del h  # graph dropped without a backward (evaluation with grad enabled)
    with off:
        layers[0](x)
    assert len(x._backward_hooks) <= 1  # only the forward in progress


def test_memory_comes_back_without_garbage_collection() -> None:
    """No reference cycle holds a Step, its groups or the layers (gc disabled)."""
    gc.collect()
    gc.disable()
    try:
        layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
        off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
        x = torch.randn(2, 16, 64, requires_grad=True)
        h = x
        with off:
            for layer in layers:
                h = layer(h)
        h.sum().backward()
        assert off.stats.bytes_offloaded > 0
        # the last step's own stats object (``stats`` returns it), held by that step
        # alone: it dies with the step
        step_ref = weakref.ref(off.stats)
        layer_ref = weakref.ref(layers[0])
        del h, off, layers, x
        assert step_ref() is None
        assert layer_ref() is None
    finally:
        gc.enable()


# ---- 2. nesting the TE-style context ----------------------------------------------------


class _Counting:
    def __init__(self) -> None:
        self.packed = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t


def test_nested_manual_context_raises_and_restores_hooks() -> None:
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=1, model_layers=2)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    counting = _Counting()
    with torch.autograd.graph.saved_tensors_hooks(counting.pack, counting.unpack):
        with pytest.raises(RuntimeError, match="already entered"):
            with ctx:
                with ctx:
                    lin(x)
        # the thread's hook stack is what it was: the outer (counting) pair sees saves
        before = counting.packed
        y = lin(x).exp()
        assert counting.packed > before
    assert ctx.step is None or not ctx.step.pending
    y.sum().backward()
    # and the context still works afterwards
    h = x
    for _ in range(2):
        with ctx:
            h = lin(h)
        h = sync(h)
    h.sum().backward()


# ---- 3. a stable schedule ------------------------------------------------------------------


def _pattern(off: offload.ActivationOffloader) -> list[list[int]]:
    inner = Internals(off)
    steps = inner.unfinished_steps()
    last = inner.last_step()
    if last is not None and last not in steps:
        steps.append(last)
    return [[int(g.offload) for g in s.groups] for s in steps]


def test_schedule_is_a_function_of_position_in_the_forward() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)

    def micro(ls, xs, o):
        for p in ls.parameters():
            p.grad = None
        with o if o is not None else models.contextlib.nullcontext():
            loss = sum(models.run_plain(ls, xi).square().mean() for xi in xs)
        pattern = _pattern(o) if o is not None else None
        loss.backward()
        return pattern, [p.grad.clone() for p in ls.parameters()]

    for it in range(3):
        xs = [torch.randn(8, 32, requires_grad=True) for _ in range(2)]
        pattern, got = micro(layers, xs, off)
        assert pattern == [[1, 1, 1, 0], [1, 1, 1, 0]], (it, pattern)
        _, want = micro(ref, [x.detach().requires_grad_() for x in xs], None)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # a single forward afterwards: the last call is not offloaded
    pattern, _ = micro(layers, [torch.randn(8, 32)], off)
    assert pattern[-1] == [1, 1, 1, 0]
    assert off.stats.layers[-1].bytes_offloaded == 0


# ---- 4. two offloaders nested ---------------------------------------------------------------


def test_two_offloaders_nested_raise() -> None:
    layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    a = offload.ActivationOffloader(layers[:2], offload_layers=1, min_tensor_bytes=0)
    b = offload.ActivationOffloader(layers[2:], offload_layers=1, min_tensor_bytes=0)
    counting = _Counting()
    with torch.autograd.graph.saved_tensors_hooks(counting.pack, counting.unpack):
        with pytest.raises(RuntimeError, match="another offload context"):
            with a, b:
                pass
        before = counting.packed
        torch.randn(3, requires_grad=True).exp()
        assert counting.packed == before + 1  # a's hooks are gone too
    # each works alone afterwards
    x = torch.randn(4, 32, requires_grad=True)
    with a:
        h = models.run_plain(layers[:2], x)
    h.sum().backward()
    assert a.stats.bytes_offloaded > 0


# ---- 5. silent no-ops ---------------------------------------------------------------------


def test_layers_never_called_warn() -> None:
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    other = nn.Linear(8, 8)
    off = offload.ActivationOffloader(layers)
    with pytest.warns(UserWarning, match="none of the 3 layers"):
        with off:
            other(torch.randn(2, 8, requires_grad=True))


def test_single_module_with_default_warns() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.warns(UserWarning, match="offloads? nothing|nothing will be offloaded"):
        offload.ActivationOffloader([model])


def test_nothing_offloaded_warns_with_the_reason() -> None:
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    off = offload.ActivationOffloader(layers)  # default min_tensor_bytes: all small
    with pytest.warns(UserWarning, match="'small'.*min_tensor_bytes"):
        with off:
            models.run_plain(layers, torch.randn(2, 8, requires_grad=True))


def test_report_before_any_forward_says_so() -> None:
    from rich.console import Console

    off = offload.ActivationOffloader([nn.Linear(4, 4), nn.Linear(4, 4)])
    console = Console(record=True, width=80)
    off.report(console)
    assert "no forward has run" in console.export_text()


# ---- 6. a callable with the wrong signature -------------------------------------------------


def test_callable_selection_signature_checked_at_construction() -> None:
    layers = [nn.Linear(4, 4) for _ in range(3)]
    with pytest.raises(TypeError, match=r"offload_layers.*\(index, module\)"):
        offload.ActivationOffloader(layers, offload_layers=lambda i: i < 2)
    offload.ActivationOffloader(layers, offload_layers=lambda i, m: i < 2)


# ---- 7. frozen weights under autocast ----------------------------------------------------


class LoraBlock(nn.Module):
    def __init__(self, dim: int = 128, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.a = nn.Linear(dim, rank, bias=False)
        self.b = nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.base(x) + self.b(self.a(x)))


def test_frozen_weight_casts_under_autocast_stay_on_the_device() -> None:
    torch.manual_seed(0)
    dim, n = 128, 64
    layers = nn.ModuleList(LoraBlock(dim) for _ in range(3))
    ref = twin(layers)

    def go(ls, off):
        for p in ls.parameters():
            p.grad = None
        x = torch.randn(n, dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with off if off is not None else models.contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = models.run_plain(ls, x)
        y.float().square().mean().backward()
        return [p.grad.clone() for p in ls.parameters() if p.requires_grad]

    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    got, want = go(layers, off), go(ref, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for layer in off.stats.layers[:2]:
        assert layer.bytes_offloaded > 0
        # the bf16 casts of the frozen dim x dim weight never travel
        assert layer.bytes_kept["parameter"] >= dim * dim * 2
        assert layer.bytes_offloaded < 3 * n * dim * 2 + 2 * n * 4 * 2 + 1024


# ---- 8. warnings point at the caller ---------------------------------------------------------


def test_host_limit_warning_points_at_the_callers_code() -> None:
    layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0, host_memory_limit=0)
    x = torch.randn(8, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with off:
            y = models.run_plain(layers, x)
    y.sum().backward()
    limit = [w for w in caught if "host_memory_limit" in str(w.message)]
    assert limit and all(w.filename != offload.__file__ for w in limit)
    assert limit[0].filename.endswith(("test_everyday.py", "models.py")), limit[0].filename


def test_bitwise_equal_with_shared_input_and_micro_batches() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    x = torch.randn(2, 16, 64)
    for it in range(2):
        got = step(layers, x + it, models.run_plain, off)
        want = step(layers, x + it, models.run_plain)
        assert_same(got, want)
        assert off.stats.bytes_offloaded > 0


# ---- layers that are not offloaded run without our hooks ----------------------------------

_top = torch._C._autograd._top_saved_tensors_default_hooks


def test_layers_not_offloaded_run_without_hooks_and_stay_bitwise() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(32, 2, 64) for _ in range(4))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=[1], min_tensor_bytes=0)
    seen: list[object] = []

    def probe(module: nn.Module, args: object) -> None:
        seen.append(_top(False))  # the innermost hooks while the layer runs

    x = torch.randn(2, 8, 32, requires_grad=True)
    h = x
    for la in ref:
        h = la(h)
    h.float().square().mean().backward()
    with off:  # our module hooks are registered on entry: the probes run after them
        handles = [la.register_forward_pre_hook(probe) for la in layers]
        h = x
        for la in layers:
            h = la(h)
    for hd in handles:
        hd.remove()
    h.float().square().mean().backward()
    assert [s is not None for s in seen] == [False, True, False, False]
    assert _top(False) is None  # the thread's hook stack is as before the entry
    got = [p.grad for p in layers.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, [p.grad for p in ref.parameters()]))
    stats = off.stats
    assert [la.bytes_offloaded > 0 for la in stats.layers] == [False, True, False, False]


def test_callers_hooks_inside_the_context_are_left_in_place() -> None:
    """A caller's hooks pushed inside ``with offloader:`` around a layer that is not
    offloaded stay innermost (ours are not popped from under them)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
    off = offload.ActivationOffloader(layers, offload_layers=0, min_tensor_bytes=0)
    counting = _Counting()
    x = torch.randn(4, 16, requires_grad=True)
    with off:
        mine = _top(False)
        with torch.autograd.graph.saved_tensors_hooks(counting.pack, counting.unpack):
            h = layers[0](x)
        assert _top(False) == mine  # ours again after the caller's block
        h = layers[1](h)
        assert _top(False) == mine
        h = layers[2](h).exp()
    assert counting.packed > 0  # the caller's hooks saw layer 0's saves
    assert _top(False) is None
    h.sum().backward()


def test_exception_in_a_layer_not_offloaded_restores_the_hook_stack() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.exp()
            raise ValueError("boom")

    layers = [nn.Linear(8, 8), Boom()]
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    x = torch.randn(2, 8, requires_grad=True)
    counting = _Counting()
    with torch.autograd.graph.saved_tensors_hooks(counting.pack, counting.unpack):
        outer = _top(False)
        with pytest.raises(ValueError, match="boom"):
            with off:
                layers[1](layers[0](x))
        assert _top(False) == outer
    assert _top(False) is None
    # in-place changes to a tensor saved in a layer that is not offloaded are still
    # caught (by autograd's own check)
    layers2 = [nn.Linear(8, 8), nn.Linear(8, 8)]
    off2 = offload.ActivationOffloader(layers2, offload_layers=1, min_tensor_bytes=0)
    with off2:
        h = layers2[0](x).exp()
        a = layers2[1](h)  # saves h, in layer 1, which is not offloaded
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        a.sum().backward()


def test_scalars_and_empty_tensors_neither_travel_nor_choose_the_device() -> None:
    class ScalarFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x * torch.tensor(2.0)))  # saves the scalar first

    torch.manual_seed(0)
    layers = nn.ModuleList(ScalarFirst() for _ in range(3))
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(8, 16)
    assert_same(step(layers, x, models.run_plain, off), step(ref, x, models.run_plain, None))
    stats = off.stats
    # the first scalar came before any device was chosen: kept; later ones are on the
    # chosen device and go the usual way (min_tensor_bytes=0: they travel)
    assert stats.bytes_kept["small"] == 4
    assert [la.bytes_offloaded > 0 for la in stats.layers] == [True, True, False]


# ---- 8. two threads, one offloader each, one shared model ----------------------------------


def two_threads_share_a_model(device: str, steps: int = 15) -> None:
    """Two threads, each with its own offloader over the same layers of one model with
    frozen weights, ``steps`` steps each: the layer hooks of one offloader fire on both
    threads and must act only on the thread that entered it. Input gradients are
    ``torch.equal`` to a run without offloading, and both offloaders offload."""
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(32, 2, 64) for _ in range(4)).to(device)
    layers.requires_grad_(False)
    inputs = [[torch.randn(2, 8, 32, device=device) + i for i in range(steps)] for _ in range(2)]

    def input_grads(xs: list[torch.Tensor], off: Any) -> list[torch.Tensor]:
        grads = []
        for x in xs:
            x = x.clone().requires_grad_(True)
            with off if off is not None else contextlib.nullcontext():
                y = models.run_plain(layers, x)
            y.float().square().mean().backward()
            grads.append(x.grad)
        return grads

    want = [input_grads(xs, None) for xs in inputs]
    offloaders = [
        offload.ActivationOffloader(layers, offload_layers=[1, 2], min_tensor_bytes=0)
        for _ in range(2)
    ]
    got: list[Any] = [None, None]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait()
            got[i] = input_grads(inputs[i], offloaders[i])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[i], want[i], strict=True))
        stats = offloaders[i].stats
        assert [la.bytes_offloaded > 0 for la in stats.layers] == [False, True, True, False]
        offloaders[i].close()


def test_two_threads_two_offloaders_one_model() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads sharing one OpenMP pool crawl
    try:
        two_threads_share_a_model("cpu")
    finally:
        torch.set_num_threads(threads)


def test_one_offloader_entered_from_a_second_thread_raises_there() -> None:
    """While the main thread is inside ``with off:``, a second thread entering the same
    ``off`` gets a clear error, and the main thread's step is left intact."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
    x = torch.randn(8, 64)
    want = step(layers, x, models.run_plain)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    errors: list[BaseException] = []

    def enter_too() -> None:
        try:
            with off:
                models.run_plain(layers, x)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def between_layers() -> None:
        other = threading.Thread(target=enter_too)
        other.start()
        other.join()

    def runner(ls: Any, h: torch.Tensor) -> torch.Tensor:
        h = models.run_plain(ls[:2], h)
        between_layers()  # the second thread tries in the middle of this forward
        return models.run_plain(ls[2:], h)

    got = step(layers, x, runner, off)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "entered by another thread" in str(errors[0])
    assert "one offloader is entered by one thread at a time" in str(errors[0])
    assert_same(got, want)
    assert off.stats.bytes_offloaded > 0
    assert off.stats.bytes_reloaded == off.stats.bytes_offloaded
    # once the main thread has left, another thread may enter it
    done: list[Any] = []
    worker = threading.Thread(target=lambda: done.append(step(layers, x, models.run_plain, off)))
    worker.start()
    worker.join()
    assert_same(done[0], want)
    off.close()


# ---- 9. messages that name the cause -------------------------------------------------------


def test_same_module_listed_twice_raises_naming_layers_and_index() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"layers\[2\] is the same Linear as layers\[0\]"):
        offload.ActivationOffloader([a, b, a])


def test_calls_out_of_the_listed_order_warn_once() -> None:
    layers = [nn.Linear(8, 8) for _ in range(3)]
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.warns(UserWarning, match=r"call 0 ran layers\[1\].*before layers\[0\]"):
        with off:
            layers[2](layers[0](layers[1](x)))
    assert off.stats.layers[0].bytes_offloaded > 0  # call 0, whatever its module
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        with off:
            layers[2](layers[0](layers[1](x)))
        # a module called again is not out of order
        again = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
        with again:
            layers[2](layers[1](layers[1](layers[0](layers[0](x)))))


class _InnerHooks(nn.Module):
    """Pushes saved-tensor hooks around its own body."""

    def __init__(self, hooks: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.hooks = hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.hooks():
            return torch.tanh(self.lin(x))


class _OtherLibrary:
    """Another library's saved-tensor hooks."""

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __call__(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, self.unpack)


@pytest.mark.parametrize(
    "hooks, name",
    [
        (torch.autograd.graph.save_on_cpu, "torch.autograd.graph.save_on_cpu"),
        (_OtherLibrary(), f"{__name__}._OtherLibrary.unpack"),
    ],
)
def test_saved_tensor_hooks_inside_a_layer_are_named_as_the_cause(hooks: Any, name: str) -> None:
    layers = [_InnerHooks(hooks) for _ in range(3)]
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    x = torch.randn(4, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with off:
            y = models.run_plain(layers, x)
    y.sum().backward()
    messages = [str(w.message) for w in record]
    named = [m for m in messages if "none of the tensors it saved" in m]
    assert len(named) == 1 and f"here: {name})" in named[0], messages
    assert "layer call 0 (_InnerHooks)" in named[0]
    assert not any("is grad enabled" in m for m in messages), messages
    assert off.stats.bytes_offloaded == 0


def test_a_layer_that_saves_nothing_is_not_blamed_on_other_hooks() -> None:
    class Shift(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1.0  # saves nothing for backward

    layers = [Shift() for _ in range(3)]
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    with pytest.warns(UserWarning, match="saved no tensor") as record:
        with off:
            models.run_plain(layers, torch.randn(4, 16, requires_grad=True))
    assert not any("none of the tensors it saved" in str(w.message) for w in record)
