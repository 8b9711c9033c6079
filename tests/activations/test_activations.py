"""ActivationOffloader on the CPU path: same gradients bit for bit, the right groups
offloaded, originals freed, nothing leaked (docs/design.md, sections 2-5)."""

from __future__ import annotations

import contextlib
import gc
import json

import pytest
import torch
from torch import nn

import offload
from tests import models
from tests.models import assert_same, step, twin

DIM = 64


def make(kind: str, n: int = 4) -> tuple[nn.ModuleList, torch.Tensor, object]:
    torch.manual_seed(0)
    if kind == "llama":
        layers = nn.ModuleList(models.LlamaBlock(DIM) for _ in range(n))
        return layers, torch.randn(2, 16, DIM), models.run_plain
    if kind == "encoder":
        layers = models.encoder_layers(n)
        return layers, torch.randn(2, 16, 32), models.run_plain
    if kind == "kwargs":
        layers = nn.ModuleList(models.KwargsBlock(DIM) for _ in range(n))
        return layers, torch.randn(2, 16, DIM), models.run_kwargs
    if kind == "inplace":
        layers = nn.ModuleList(models.InplaceBlock(DIM) for _ in range(n))
        return layers, torch.randn(2, 16, DIM), models.run_inplace_outside
    if kind == "checkpoint":
        layers = nn.ModuleList(models.LlamaBlock(DIM) for _ in range(n))
        return layers, torch.randn(2, 16, DIM), models.run_checkpointed
    raise AssertionError(kind)


KINDS = ["llama", "encoder", "kwargs", "inplace", "checkpoint"]
SELECTIONS = {
    "none": (None, [0, 1, 2]),
    "zero": (0, []),
    "int": (2, [0, 1]),
    "list": ([1, 3], [1, 3]),
    "callable": (lambda i, m: i % 2 == 0, [0, 2]),
}


def expected_offloaded(kind: str, selected: list[int], n: int) -> list[int]:
    """Groups that must report offloaded bytes.

    With reentrant checkpointing only the checkpoint's saved inputs reach the hooks,
    after the layer's own hooks fired: they belong to the next group to open (docs/design.md,
    section 2), so group i carries layer i-1's input; group 0 carries nothing.
    """
    if kind == "checkpoint":
        return [i for i in selected if i >= 1]
    return selected


@pytest.mark.parametrize("selection", list(SELECTIONS))
@pytest.mark.parametrize("kind", KINDS)
def test_same_gradients_three_steps(kind: str, selection: str) -> None:
    layers, x, runner = make(kind)
    ref_layers = twin(layers)
    sel, selected = SELECTIONS[selection]
    off = offload.ActivationOffloader(layers, offload_layers=sel, min_tensor_bytes=1024)
    # the probed activation is saved by the layer itself except under checkpointing
    probed = selected if kind in ("llama", "kwargs", "inplace") else None
    for it in range(3):
        xi = x + it  # fresh inputs each step
        got = step(
            layers,
            xi,
            runner,
            off,
            after_forward=None if probed is None else lambda: models.check_released(layers, probed),
        )
        want = step(ref_layers, xi, runner)
        assert_same(got, want)
        stats = off.stats
        assert [la.offloaded for la in stats.layers] == [i in selected for i in range(4)]
        must = expected_offloaded(kind, selected, 4)
        for i, layer_stats in enumerate(stats.layers):
            if i in must:
                assert layer_stats.bytes_offloaded > 0, (i, layer_stats)
            if i not in selected:
                assert layer_stats.bytes_offloaded == 0
        assert stats.bytes_offloaded == sum(la.bytes_offloaded for la in stats.layers)
        assert stats.bytes_reloaded == stats.bytes_offloaded
        assert stats.host_pool_bytes == 0  # graph freed by backward: blocks returned
    off.close()


@pytest.mark.parametrize("kind", ["llama", "kwargs", "inplace"])
def test_offloaded_originals_are_released(kind: str) -> None:
    layers, x, runner = make(kind)
    off = offload.ActivationOffloader(layers, offload_layers=[0, 2], min_tensor_bytes=1024)
    x = x.clone().requires_grad_(True)
    with off:
        loss = runner(layers, x).square().mean()
    gc.collect()
    # selected groups dropped their device references; the others still hold theirs
    assert layers[0].probe.expired() and layers[2].probe.expired()
    assert not layers[1].probe.expired() and not layers[3].probe.expired()
    loss.backward()
    off.close()


def test_two_micro_batches_before_backward() -> None:
    layers, x, runner = make("llama")
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    xs = [torch.randn_like(x) for _ in range(2)]

    def accumulate(ls, offloader):
        for p in ls.parameters():
            p.grad = None
        losses = []
        for xi in xs:
            with offloader if offloader else contextlib.nullcontext():
                losses.append(runner(ls, xi.requires_grad_(False)).square().mean())
            if offloader:
                assert all(la.bytes_offloaded > 0 for la in offloader.stats.layers[:3])
                models.check_released(ls, [0, 1, 2])
        for loss in reversed(losses):  # backwards in the other order
            loss.backward()
        return [p.grad.clone() for p in ls.parameters()]

    got = accumulate(layers, off)
    want = accumulate(ref, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert off.stats.host_pool_bytes == 0


def test_retain_graph_backward_twice() -> None:
    layers, x, runner = make("llama")
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    got = step(
        layers,
        x,
        runner,
        off,
        backwards=2,
        after_forward=lambda: models.check_released(layers, [0, 1, 2]),
    )
    want = step(ref, x, runner, backwards=2)
    assert_same(got, want)
    assert all(la.bytes_offloaded > 0 for la in off.stats.layers[:3])
    # two backwards reload everything twice
    assert off.stats.bytes_reloaded == 2 * off.stats.bytes_offloaded


def test_saved_tensor_read_twice() -> None:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            (b,) = ctx.saved_tensors
            assert torch.equal(a, b)
            return g * 2 + 0 * a

    class Block(nn.Module):
        def forward(self, x):
            return Twice.apply(x.exp())

    layers = nn.ModuleList([Block(), Block()])
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = layers[1](layers[0](x))
    y.sum().backward()
    want = x.exp() * 2 * 2 * (x.exp() * 2).exp()
    assert torch.allclose(x.grad, want)
    assert off.stats.layers[0].bytes_offloaded > 0


@pytest.mark.parametrize("op", ["exp", "sigmoid", "softmax", "tanh"])
def test_self_saving_ops_leak_nothing(op: str) -> None:
    """Ops that save their own output would form a cycle if the hook returned its input."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(128, 128)

        def forward(self, x):
            y = self.fc(x)
            return torch.softmax(y, -1) if op == "softmax" else getattr(torch, op)(y)

    layers = nn.ModuleList([Block(), Block()])
    off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
    gc.collect()
    gc.disable()  # only reference counting may free the graph
    try:
        x = torch.randn(64, 128, requires_grad=True)
        with off:
            out = layers[1](layers[0](x))
        ref = models.StorageWeakRef(out.untyped_storage())
        assert off.stats.bytes_offloaded > 0
        del out
        assert ref.expired()
        assert off.stats.host_pool_bytes == 0
    finally:
        gc.enable()


def test_exception_in_forward_frees_everything() -> None:
    layers, x, runner = make("llama")
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    before = {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers}

    class Boom(RuntimeError):
        pass

    kept = []
    with pytest.raises(Boom):
        with off:
            y = layers[0](x.requires_grad_(True))
            y = layers[1](y)
            kept.append(y)  # the failed forward's graph stays reachable
            raise Boom
    assert off.stats.host_pool_bytes == 0
    assert off.stats.bytes_offloaded > 0
    after = {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers}
    assert after == before
    # no saved-tensor hooks left installed: a plain forward/backward works unhooked
    out = layers[0](torch.randn(2, 16, DIM, requires_grad=True)).sum()
    out.backward()
    # the failed graph can no longer be unpacked, and says why
    with pytest.raises(RuntimeError, match="raised an exception"):
        kept[0].sum().backward()
    # and the offloader works again
    got = step(layers, x.detach(), runner, off)
    assert off.stats.bytes_offloaded > 0 and got[0].isfinite()


def test_host_memory_limit_keeps_tensors_and_stays_correct() -> None:
    layers, x, runner = make("llama")
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024, host_memory_limit=40_000)
    with pytest.warns(RuntimeWarning, match="host_memory_limit"):
        got = step(layers, x, runner, off)
    assert_same(got, step(ref, x, runner))
    stats = off.stats
    assert stats.bytes_kept["host_limit"] > 0
    assert 0 < stats.bytes_offloaded <= 40_000
    assert stats.host_pool_reserved_bytes <= 40_000


def test_variable_sequence_lengths_keep_pool_bounded() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(DIM) for _ in range(3))
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    reserved, peak_step = [], 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        seq = int(torch.randint(8, 256, (1,), generator=gen))
        step(layers, torch.randn(2, seq, DIM), models.run_plain, off)
        reserved.append(off.stats.host_pool_reserved_bytes)
        peak_step = max(peak_step, off.stats.bytes_offloaded)
        assert off.stats.host_pool_bytes == 0
    # the first slab is large enough for every step: reuse, no growth
    assert reserved[-1] == reserved[0] == max(reserved)
    assert off.stats.host_pool_peak_bytes < 2 * peak_step + 512 * 64
    off.close()
    assert off.stats.host_pool_reserved_bytes == 0


def test_pool_grows_to_the_largest_step_then_stops() -> None:
    """With slabs smaller than one step, reserved memory tracks the largest step."""
    from offload._core import _host_pool

    old = _host_pool.MIN_SLAB_BYTES
    _host_pool.MIN_SLAB_BYTES = 64 << 10
    try:
        torch.manual_seed(0)
        layers = nn.ModuleList(models.LlamaBlock(DIM) for _ in range(3))
        off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
        reserved, biggest = [], 0
        for i in range(20):
            seq = [64, 200, 32, 128, 256][i % 5]
            step(layers, torch.randn(2, seq, DIM), models.run_plain, off)
            reserved.append(off.stats.host_pool_reserved_bytes)
            biggest = max(biggest, off.stats.bytes_offloaded)
        assert reserved[-1] == max(reserved[5:]) == reserved[5]  # flat after one cycle
        assert reserved[-1] <= 4 * biggest + (64 << 10)
    finally:
        _host_pool.MIN_SLAB_BYTES = old


def test_outside_layers_and_opt_out() -> None:
    layers, x, runner = make("llama", n=3)
    head = nn.Linear(DIM, DIM)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    x = x.clone().requires_grad_(True)
    with off:
        h = torch.tanh(x * 3)  # before the first layer
        h = layers[0](h)
        with offload.no_offload():
            h = layers[1](h)
        h = layers[2](h)
        loss = torch.sigmoid(head(h)).square().mean()  # after the last layer
    loss.backward()
    stats = off.stats
    assert stats.bytes_kept["outside_layers"] > 0
    assert stats.layers[0].bytes_offloaded > 0
    assert stats.layers[1].bytes_offloaded == 0 and stats.layers[1].bytes_kept["opted_out"] > 0
    assert stats.bytes_kept["parameter"] > 0


def _held_buffers() -> int:
    from offload._core._transfer import HostCopy

    gc.collect()
    return sum(issubclass(type(c), HostCopy) and c.buffer is not None for c in gc.get_objects())


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("kind", ["activation", "norm"])
def test_a_save_between_layer_calls_is_reloaded_once(kind: str, backwards: int) -> None:
    # Note [release order], 6: what an op between two calls saves joins the next call's
    # group, and its backward runs after that group's: its copy keeps the buffer the
    # group's reload made instead of being reloaded again on demand, and gives it up
    # with its last handle or, when a retained graph keeps the handles, at the previous
    # group's drop (the second backward then reloads what it needs)
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
    ref = twin(layers)
    run = models.run_between(kind)
    x = torch.randn(2, 16, DIM)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    held: list[int] = []
    got = step(
        layers,
        x,
        run,
        off,
        backwards=backwards,
        after_backward=lambda: held.append(_held_buffers()),
    )
    assert_same(got, step(ref, x, run, backwards=backwards))
    assert held == [0] * backwards  # no buffer outlives a backward
    models.assert_reloaded_once(off.stats, backwards)
    off.close()


def test_no_offload_decorator() -> None:
    layers = nn.ModuleList([nn.Linear(128, 128), nn.Linear(128, 128)])

    @offload.no_offload()
    def first(x):
        return torch.tanh(layers[0](x))

    off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
    with off:
        # the module hooks still fire, but what is saved inside `first` stays
        y = layers[1](first(torch.randn(64, 128, requires_grad=True)))
    y.sum().backward()
    assert off.stats.layers[0].bytes_offloaded == 0
    assert off.stats.layers[0].bytes_kept["opted_out"] > 0
    assert off.stats.layers[1].bytes_offloaded > 0


def test_tensor_filter_and_small() -> None:
    layers, x, runner = make("llama", n=2)
    off = offload.ActivationOffloader(
        layers, offload_layers=[0], min_tensor_bytes=4096, tensor_filter=lambda t: t.dim() != 4
    )
    step(layers, x, runner, off)
    kept = off.stats.layers[0].bytes_kept
    assert kept["filtered"] > 0  # the 4-d attention tensors
    assert kept["small"] > 0  # e.g. the RMSNorm statistics
    assert off.stats.layers[0].bytes_offloaded > 0


def test_parameters_never_travel() -> None:
    """nn.Linear saves weight.t(): a view of the parameter, not a Parameter (4.7)."""
    layers = nn.ModuleList([nn.Linear(256, 256, bias=False) for _ in range(3)])
    for p in layers[0].parameters():
        p.requires_grad_(False)  # frozen: no AccumulateGrad, caught by storage
    off = offload.ActivationOffloader(layers, offload_layers=3, min_tensor_bytes=0)
    x = torch.randn(8, 256, requires_grad=True)
    with off:
        y = layers[2](layers[1](layers[0](x)))
    y.sum().backward()
    stats = off.stats
    act = 8 * 256 * 4
    # the frozen layer saves only weight.t() (for the input gradient), no activation
    assert [la.bytes_offloaded for la in stats.layers] == [0, act, act]
    assert stats.bytes_offloaded == 2 * act
    assert [la.bytes_kept["parameter"] for la in stats.layers] == [256 * 256 * 4] * 3


def test_stats_contract_and_json() -> None:
    layers, x, runner = make("llama")
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024)
    step(layers, x, runner, off)
    stats = off.stats
    assert stats.bytes_offloaded > 0
    assert set(stats.bytes_kept) == {
        "small",
        "parameter",
        "not_selected",
        "outside_layers",
        "filtered",
        "host_limit",
        "opted_out",
        "shared",
        "device",
        "unsupported",
    }
    for la in stats.layers:
        assert set(la.bytes_kept) == set(stats.bytes_kept)
        assert la.d2h_seconds is None and la.h2d_seconds is None and la.stall_seconds is None
        assert isinstance(la.index, int) and isinstance(la.offloaded, bool)
    d = json.loads(json.dumps(stats.to_dict()))
    assert d["bytes_offloaded"] == stats.bytes_offloaded
    assert len(d["layers"]) == 4
    assert stats.bytes_by_dtype == {"float32": stats.bytes_offloaded}
    assert set(vars(stats)) >= {
        "bytes_offloaded",
        "bytes_kept",
        "bytes_by_dtype",
        "layers",
        "host_pool_bytes",
        "host_pool_reserved_bytes",
        "host_pool_peak_bytes",
    }


def test_report_renders(capsys) -> None:
    layers, x, runner = make("llama", n=2)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    step(layers, x, runner, off)
    off.report()
    out = capsys.readouterr().out
    assert "sent to host" in out and "offloaded" in out
    # on the CPU: says once what ran, and claims no freed device memory
    flat = " ".join(out.split())
    assert off.stats.synchronous and flat.count("the schedule ran synchronously") == 1
    assert "no device memory to save" in flat
    assert "freed" not in flat


def test_a_module_called_twice_is_two_groups() -> None:
    torch.manual_seed(0)
    block = models.LlamaBlock(DIM)
    other = models.LlamaBlock(DIM)
    layers = [block, other]
    ref = twin(nn.ModuleList(layers))

    def runner(ls, x):
        return ls[1](ls[0](ls[0](x)))

    off = offload.ActivationOffloader(layers, offload_layers=None, min_tensor_bytes=1024)
    x = torch.randn(2, 16, DIM)
    for _ in range(2):  # the second forward plans with L = 3 calls
        got = step(layers, x, runner, off)
        assert_same(got, step(ref, x, runner))
    assert len(off.stats.layers) == 3
    assert [la.bytes_offloaded > 0 for la in off.stats.layers] == [True, True, False]


def test_close_is_idempotent_and_reusable() -> None:
    layers, x, runner = make("llama", n=2)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    step(layers, x, runner, off)
    off.close()
    off.close()
    step(layers, x, runner, off)
    assert off.stats.bytes_offloaded > 0
    off.close()


@pytest.mark.filterwarnings("ignore:offload. none of the")
def test_nested_entry_is_an_error() -> None:
    layers, _, _ = make("llama", n=2)
    off = offload.ActivationOffloader(layers)
    with off:
        with pytest.raises(RuntimeError, match="already entered"):
            off.__enter__()


def test_chunks_of_one_projection_travel_once() -> None:
    """q, k, v = proj(x).chunk(3): three views that each span almost the whole storage
    are copied as one storage (4.5), and the release frees exactly what nothing else
    holds."""

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 192, bias=False)

        def forward(self, x):
            q, k, v = self.fc(x).chunk(3, dim=-1)
            return q * k * v  # saves q and k, then q * k and v

    layers = nn.ModuleList([Fused(), Fused()])
    ref = twin(layers)
    off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
    n = 256
    x = torch.randn(n, 64)
    got = step(layers, x, models.run_plain, off)
    assert_same(got, step(ref, x, models.run_plain))
    g0 = off.stats.layers[0]
    # x (saved by fc), the fc output once, q * k
    assert g0.bytes_offloaded == n * 64 * 4 + n * 192 * 4 + n * 64 * 4
    # x is still held by the caller: only the fc output and q * k are freed
    assert g0.bytes_released == n * 192 * 4 + n * 64 * 4
    assert off.stats.bytes_released == g0.bytes_released


def test_timing_fills_the_layer_times() -> None:
    layers, x, runner = make("llama")
    off = offload.ActivationOffloader(layers, min_tensor_bytes=1024, timing=True)
    step(layers, x, runner, off)
    for la in off.stats.layers:
        assert isinstance(la.d2h_seconds, float) and isinstance(la.h2d_seconds, float)
        assert la.stall_seconds == 0.0  # the synchronous path never waits
        # copies were timed exactly where something was copied
        assert (la.d2h_seconds > 0) == la.offloaded == (la.h2d_seconds > 0)
    assert json.loads(json.dumps(off.stats.to_dict()))["layers"][0]["d2h_seconds"] > 0


def test_report_shows_times_when_timed(capsys) -> None:
    layers, x, runner = make("llama", n=2)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0, timing=True)
    step(layers, x, runner, off)
    off.report()
    assert "D2H ms" in capsys.readouterr().out
