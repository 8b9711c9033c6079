"""TransformerEngine 2.10's additions to the offload API: the keyword-only arguments of
``get_cpu_offload_context`` (``manual_synchronization``, ``retain_pinned_cpu_buffers``,
``offload_stream``), the manual synchronizer driving a pipeline (1F1B) schedule, and
the module-level ``mark_not_offload`` / ``start_offload``."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from offload._core._device import SyncBackend, backend_for
from offload._core._host_pool import HostPool
from offload.activations._control import Internals
from tests import models
from tests.activations.test_tensor_kinds import FakeTEQuantized
from tests.models import twin

# ---- arguments ---------------------------------------------------------------------------


def test_new_arguments_are_keyword_only_with_te_defaults() -> None:
    params = inspect.signature(offload.get_cpu_offload_context).parameters
    for name in ("retain_pinned_cpu_buffers", "manual_synchronization", "offload_stream"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["retain_pinned_cpu_buffers"].default is False
    assert params["manual_synchronization"].default is False
    assert params["offload_stream"].default is None
    with pytest.raises(TypeError):
        offload.get_cpu_offload_context(True, 1, 2, True, False, False, True)  # type: ignore[misc]


def test_argument_errors() -> None:
    with pytest.raises(TypeError, match="manual_synchronization"):
        offload.get_cpu_offload_context(True, 1, 2, manual_synchronization=1)
    with pytest.raises(TypeError, match="retain_pinned_cpu_buffers"):
        offload.get_cpu_offload_context(True, 1, 2, retain_pinned_cpu_buffers="yes")
    with pytest.raises(TypeError, match="offload_stream must be a torch.cuda.Stream or None"):
        offload.get_cpu_offload_context(True, 1, 2, offload_stream=object())
    # num_layers keeps TE's bound without manual synchronization, and is ignored with it
    with pytest.raises(ValueError, match="num_layers"):
        offload.get_cpu_offload_context(True, num_layers=2, model_layers=2)
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, num_layers=None, model_layers=2, manual_synchronization=True
    )
    assert isinstance(sched, offload.ManualOffloadSynchronizer)
    assert sched.offload_stream is None and sched.forward is None
    offload.get_cpu_offload_context(True, 5, 2, manual_synchronization=True)
    with pytest.raises(TypeError, match="num_layers"):
        offload.get_cpu_offload_context(True, num_layers=None, model_layers=2)
    # disabled: TE's shapes of the no-op result
    ctx, sync, sched = offload.get_cpu_offload_context(manual_synchronization=True)
    assert isinstance(ctx, contextlib.nullcontext) and sched is None
    t = torch.ones(1)
    assert sync(t) is t
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=2, offload_activations=False, manual_synchronization=True
    )
    assert isinstance(ctx, contextlib.nullcontext) and sched is None
    # offload_weights has no effect in manual mode (TE 2.10: never has), and says so
    with pytest.warns(UserWarning, match="offload_weights=True has no effect"):
        ctx, sync, sched = offload.get_cpu_offload_context(
            True, model_layers=2, offload_weights=True, manual_synchronization=True
        )
    assert not hasattr(ctx, "weights") and sched is not None


class _FakeStream:
    """Stands in for torch.cuda.Stream on a machine without CUDA."""

    device = torch.device("cuda", 0)


def test_offload_stream_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    stream = _FakeStream()
    # TE asserts that a stream comes with manual synchronization
    with pytest.raises(ValueError, match="only with manual_synchronization=True"):
        offload.get_cpu_offload_context(True, 1, 2, offload_stream=stream)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            offload.get_cpu_offload_context(
                True, model_layers=2, manual_synchronization=True, offload_stream=stream
            )
    # disabled: no check beyond the type, as in TE
    offload.get_cpu_offload_context(False, offload_stream=stream)
    # a stream never drives tensors of another device
    with pytest.raises(RuntimeError, match="offload_stream is a CUDA stream"):
        backend_for(torch.device("cpu"), stream)


def test_offload_stream_none_changes_nothing() -> None:
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=1, model_layers=2)
    assert ctx.runtime.offload_stream is None and not ctx.runtime.retain_host
    assert isinstance(ctx.runtime.backend(torch.device("cpu")), SyncBackend)
    assert isinstance(backend_for(torch.device("cpu"), None), SyncBackend)


def test_synchronizer_errors() -> None:
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(3))
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=3, manual_synchronization=True
    )
    with pytest.raises(RuntimeError, match="no forward has started"):
        sched.start_offload_layer(0)
    x = torch.randn(2, 1024, 64, requires_grad=True)
    with ctx:
        x = layers[0](x)
        with pytest.raises(RuntimeError, match="still running"):
            sched.start_offload_layer(0)
    x = sync(x)
    with pytest.raises(TypeError, match="layer_id must be an int"):
        sched.start_offload_layer("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layer_id=3 is out of range.*model_layers=3"):
        sched.start_offload_layer(3)
    with pytest.raises(RuntimeError, match="layer 1 of forward 0 has not run yet"):
        sched.start_offload_layer(1)
    with pytest.raises(ValueError, match="forward=1 has not started"):
        sched.start_offload_layer(0, forward=1)
    with pytest.raises(TypeError, match="forward must be an int or None"):
        sched.start_offload_layer(0, forward=0.0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="out of order.*'saved'.*needs 'offload_started'"):
        sched.release_activation_forward_gpu_memory(0)
    with pytest.raises(RuntimeError, match="out of order.*needs 'released'"):
        sched.start_reload_layer(0)
    sched.start_offload_layer(0)
    with pytest.raises(RuntimeError, match="start_offload_layer\\(0\\) out of order"):
        sched.start_offload_layer(0)
    sched.release_activation_forward_gpu_memory(0)
    with pytest.raises(RuntimeError, match="out of order"):
        sched.release_activation_forward_gpu_memory(0)
    sched.start_reload_layer(0)
    with pytest.raises(RuntimeError, match="out of order"):
        sched.start_reload_layer(0)
    assert sched.state(0) == "reload_started" and sched.state(2) == "not_run"
    for layer in layers[1:]:
        with ctx:
            x = layer(x)
        x = sync(x)
    x.sum().backward()


# ---- the manual synchronizer in a pipeline schedule --------------------------------------


def _grads(layers: nn.ModuleList) -> list[torch.Tensor]:
    return [p.grad.clone() for p in layers.parameters()]


def _one_f_one_b(device: str) -> None:
    """One pipeline stage of four layers running two micro-batches with 1F1B's order
    (F0 F1 B0 B1: both forwards are in flight before the first backward). The manual
    calls sit where a pipeline schedule puts them: each layer's offload starts right
    after its forward; micro-batch 0's layers are released while micro-batch 1's
    forward runs (each just before the layer of micro-batch 1 that needs the memory);
    each backward's layers are reloaded just before it. Micro-batch 1 never offloads
    its last layer (TE: a layer that is never started is not offloaded)."""
    torch.manual_seed(0)
    n = 4
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(n)).to(device)
    ref = twin(layers)
    xs = [torch.randn(2, 1024, 64, device=device) for _ in range(2)]

    # the same schedule without offloading: losses and accumulated gradients
    inputs = [x.clone().requires_grad_(True) for x in xs]
    want_loss = [models.run_plain(ref, x).float().square().mean() for x in inputs]
    for loss in want_loss:
        loss.backward()
    want = _grads(ref) + [x.grad for x in inputs]

    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=n, manual_synchronization=True
    )
    inputs = [x.clone().requires_grad_(True) for x in xs]

    # F0
    h = inputs[0]
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        assert sched.stats().layers[i].bytes_offloaded == 0  # nothing copied before start
        assert sched.state(i) == "saved"
        sched.start_offload_layer(i)
        assert sched.stats().layers[i].bytes_offloaded > 0
    f0 = sched.forward
    loss0 = h.float().square().mean()
    probes0 = [layer.probe for layer in layers]
    assert not any(p.expired() for p in probes0)  # copied, but not released yet

    # F1, releasing micro-batch 0's layer i just before micro-batch 1's layer i runs
    h = inputs[1]
    for i, layer in enumerate(layers):
        sched.release_activation_forward_gpu_memory(i, forward=f0)
        assert [p.expired() for p in probes0] == [j <= i for j in range(n)]
        with ctx:
            h = layer(h)
        h = sync(h)
        if i < n - 1:
            sched.start_offload_layer(i)
    f1 = sched.forward
    assert f1 == f0 + 1
    loss1 = h.float().square().mean()
    probes1 = [layer.probe for layer in layers]
    assert sched.state(n - 1, forward=f1) == "saved"

    # B0: reload micro-batch 0 (last layer first), then its backward
    stats0 = sched.stats(f0)
    per_layer = [la.bytes_offloaded for la in stats0.layers]
    reloaded = 0
    for i in reversed(range(n)):
        sched.start_reload_layer(i, forward=f0)
        reloaded += per_layer[i]
        assert sched.stats(f0).bytes_reloaded == reloaded  # the reload ran at the call
    # micro-batch 1 frees its device copies while micro-batch 0's backward runs
    for i in range(n - 1):
        sched.release_activation_forward_gpu_memory(i, forward=f1)
    assert [p.expired() for p in probes1] == [True] * (n - 1) + [False]
    assert sched.state(0, forward=f0) == "reload_started"
    loss0.backward()
    assert sched.state(0, forward=f0) == "over"  # its saved tensors are gone
    sched.start_reload_layer(0, forward=f0)  # naming a forward that is over does nothing

    # B1
    for i in reversed(range(n - 1)):
        sched.start_reload_layer(i, forward=f1)
    loss1.backward()

    got = _grads(layers) + [x.grad for x in inputs]
    assert torch.equal(loss0.detach(), want_loss[0].detach())
    assert torch.equal(loss1.detach(), want_loss[1].detach())
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"gradient {i} differs: max {(a - b).abs().max()}"

    stats0, stats1 = sched.stats(f0), sched.stats(f1)
    assert stats0.bytes_offloaded > 0 and stats0.bytes_reloaded == stats0.bytes_offloaded
    # released: what the releases freed (the caller's input stays alive, so not all)
    assert stats0.bytes_released > 0 and stats1.bytes_released > 0
    assert stats1.layers[n - 1].bytes_offloaded == 0  # never started
    assert stats1.layers[n - 1].bytes_kept["not_selected"] > 0
    assert stats1.bytes_reloaded == stats1.bytes_offloaded > 0


def test_manual_synchronizer_drives_1f1b_schedule() -> None:
    _one_f_one_b("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_manual_synchronizer_drives_1f1b_schedule_cuda() -> None:
    _one_f_one_b("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_stream_carries_the_copies_cuda() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(3)).cuda()
    ref = twin(layers)
    stream = torch.cuda.Stream()
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=3, manual_synchronization=True, offload_stream=stream
    )
    assert sched.offload_stream is stream
    x = torch.randn(2, 1024, 64, device="cuda")
    h = x.clone().requires_grad_(True)
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        sched.start_offload_layer(i)
    backend = ctx.runtime.backend(h.device)
    assert backend.d2h_stream is stream and backend.h2d_stream is stream
    stream.synchronize()  # TE's docs: wait for every offload, then release
    for i in range(3):
        sched.release_activation_forward_gpu_memory(i)
    for i in reversed(range(3)):
        sched.start_reload_layer(i)
    loss = h.square().mean()
    loss.backward()
    got = _grads(layers)
    r = x.clone().requires_grad_(True)
    want_loss = models.run_plain(ref, r).square().mean()
    want_loss.backward()
    assert torch.equal(loss.detach(), want_loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(got, _grads(ref)))
    assert sched.stats().bytes_reloaded == sched.stats().bytes_offloaded > 0


def test_manual_layer_never_started_is_not_offloaded() -> None:
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(2))
    ref = twin(layers)
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=2, manual_synchronization=True
    )
    x = torch.randn(2, 1024, 64)
    got = models.step(layers, x, lambda ls, h: _run_ctx(ls, h, ctx, sync))
    assert got[0].equal(models.step(ref, x, models.run_plain)[0])
    stats = sched.stats()
    assert stats.bytes_offloaded == 0 and stats.bytes_kept["not_selected"] > 0


def test_manual_release_without_reload_reloads_on_demand() -> None:
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(2))
    ref = twin(layers)
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=2, manual_synchronization=True
    )

    def run(ls: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
        h = _run_ctx(ls, h, ctx, sync, sched)
        sched.release_activation_forward_gpu_memory(0)  # layer 1: never released
        return h

    x = torch.randn(2, 1024, 64)
    models.assert_same(
        models.step(layers, x, run, retain_graph=False),
        models.step(ref, x, models.run_plain),
    )
    assert sched.stats().bytes_reloaded == sched.stats().bytes_offloaded > 0


def _run_ctx(ls, h, ctx, sync, sched=None):
    """Each layer in its own ``with ctx:`` entry; ``sched``: start each one's offload."""
    for i, layer in enumerate(ls):
        with ctx:
            h = layer(h)
        h = sync(h)
        if sched is not None:
            sched.start_offload_layer(i)
    return h


# ---- retain_pinned_cpu_buffers ------------------------------------------------------------


def test_retain_keeps_empty_slabs_when_over_budget() -> None:
    for retain in (False, True):
        pool = HostPool(256 << 10, pin=False, min_slab=64 << 10, retain=retain)
        a, b = pool.allocate(64 << 10), pool.allocate(64 << 10)
        assert a is not None and b is not None and pool.reserved_bytes == 128 << 10
        slabs = list(pool._slabs)
        pool.free(a)
        pool.free(b)
        big = pool.allocate(200 << 10)  # needs a 256 KiB slab: over budget with both kept
        if retain:
            assert big is None  # refused: the two empty slabs stay where they are
            assert pool._slabs == slabs and pool.reserved_bytes == 128 << 10
        else:
            assert big is not None  # the empty slabs were returned for one that fits
            assert not any(s in pool._slabs for s in slabs)


def test_retain_pinned_cpu_buffers_same_results_and_fixed_pool() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(3))
    ref = twin(layers)
    ctx, sync = offload.get_cpu_offload_context(
        True, num_layers=2, model_layers=3, retain_pinned_cpu_buffers=True
    )
    assert ctx.runtime.retain_host and ctx.runtime.pool.retain
    reserved = set()
    for _ in range(3):
        x = torch.randn(2, 1024, 64)
        got = models.step(layers, x, lambda ls, h: _run_ctx(ls, h, ctx, sync))
        models.assert_same(got, models.step(ref, x, models.run_plain))
        assert ctx.stats.bytes_offloaded > 0
        reserved.add(ctx.stats.host_pool_reserved_bytes)
    assert len(reserved) == 1  # the same slabs every step


# ---- mark_not_offload / start_offload ---------------------------------------------------


class _Saver(torch.autograd.Function):
    """Saves ``extra`` (any tensor) and returns ``x * 2``."""

    @staticmethod
    def forward(ctx, x, extra):
        ctx.save_for_backward(x, extra)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        x, extra = ctx.saved_tensors
        ctx.extra_seen = extra.clone()
        return g * 2, None


class _SaveBlock(nn.Module):
    def __init__(self, make_extra, after=None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.make_extra = make_extra
        self.after = after
        self.fns: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.make_extra(x)
        y = _Saver.apply(x * self.w, extra)
        self.fns.append(y.grad_fn)
        if self.after is not None:
            self.after(extra)
        return y


def _te_step(blocks, x, **kw):
    ctx, sync = offload.get_cpu_offload_context(True, 1, len(blocks), **kw)
    h = x.clone().requires_grad_(True)
    for b in blocks:
        with ctx:
            h = b(h)
        h = sync(h)
    h.sum().backward()
    return ctx.stats


def test_mark_not_offload_keeps_tensors() -> None:
    big = torch.randn(256, 256)
    offload.mark_not_offload(big, None)
    assert big._TE_do_not_offload is True
    blocks = [_SaveBlock(lambda x: big), _SaveBlock(lambda x: x)]
    stats = _te_step(blocks, torch.randn(256, 256))
    assert stats.layers[0].bytes_kept["opted_out"] == big.nbytes
    assert stats.layers[0].bytes_offloaded > 0  # the block's own activations still go
    assert torch.equal(blocks[0].fns[0].extra_seen, big)
    # the ActivationOffloader honours the same mark
    blocks = nn.ModuleList([_SaveBlock(lambda x: big), _SaveBlock(lambda x: x)])
    off = offload.ActivationOffloader(blocks, offload_layers=1, min_tensor_bytes=0)
    with off:
        h = blocks[1](blocks[0](torch.randn(256, 256, requires_grad=True)))
    h.sum().backward()
    assert off.stats.layers[0].bytes_kept["opted_out"] == big.nbytes
    with pytest.raises(TypeError, match="expected tensors"):
        offload.mark_not_offload(3)


def test_mark_not_offload_te_quantized_marks_its_data_tensors() -> None:
    data = torch.randn(256, 256).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.5)
    q = FakeTEQuantized(data, scale, torch.float32)
    offload.mark_not_offload(q)
    assert q._data is data and q._scale_inv is scale  # refilled with the same tensors
    assert data._TE_do_not_offload and scale._TE_do_not_offload
    assert "_TE_do_not_offload" not in q.__dict__

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, q):
            ctx.save_for_backward(q)
            return x * 1

        @staticmethod
        def backward(ctx, g):
            (saved,) = ctx.saved_tensors
            ctx.seen = saved.dequantize()
            return g, None

    class QBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return Keep.apply(x * self.w, q)

    blocks = [QBlock(), QBlock()]
    stats = _te_step(blocks, torch.randn(256, 256))
    assert stats.layers[0].bytes_kept["opted_out"] == data.nbytes + scale.nbytes
    assert stats.bytes_by_dtype.get("float8_e4m3fn", 0) == 0


def test_start_offload_outside_any_context_only_marks() -> None:
    base = torch.randn(64, 3 * 64)
    q, k, v = base.chunk(3, dim=-1)
    plain = torch.randn(8)
    offload.start_offload(q, None, plain)
    assert "offload_base_tensor" not in q.__dict__
    offload.start_offload(q, k, v, plain, offload_base_tensor=True)
    assert q.offload_base_tensor and k.offload_base_tensor and v.offload_base_tensor
    assert "offload_base_tensor" not in plain.__dict__  # not a view
    offload.start_offload()
    with pytest.raises(TypeError, match="offload_base_tensor must be a bool"):
        offload.start_offload(q, offload_base_tensor=1)
    with pytest.raises(TypeError, match="expected tensors"):
        offload.start_offload("q")


def _queued(step) -> int:
    """Saved tensors whose D2H copy is not issued yet: queued, in an open bucket of
    small tensors (gathered copies), or held back by the step's first layer call (placed
    at its close, Note [release order], 1(c); one copy per storage)."""
    deferred = step.open.deferred if step.open is not None else None
    held = len({t.untyped_storage()._cdata for _, t, _ in deferred or ()})
    return len(step.d2h_queue) + sum(len(b.sources) for b in step.buckets.values()) + held


def test_start_offload_issues_the_queued_copy() -> None:
    seen: list[tuple[int, int]] = []
    holder: dict = {}

    def after(extra: torch.Tensor) -> None:
        step = holder["step"]()
        if step is None:  # the reference model (a copy of the blocks), run outside
            offload.start_offload(extra)
            return
        before = _queued(step)
        offload.start_offload(extra)
        seen.append((before, _queued(step)))

    blocks = nn.ModuleList([_SaveBlock(lambda x: x.exp(), after), _SaveBlock(lambda x: x)])
    ref = twin(blocks)
    off = offload.ActivationOffloader(blocks, offload_layers=1, min_tensor_bytes=0)
    holder["step"] = Internals(off).current_step
    x = torch.randn(256, 256)
    got = models.step(blocks, x, models.run_plain, off)
    # x (saved by x * w), exp(x) and x * w were queued; start_offload issued them
    assert seen == [(3, 0)]
    models.assert_same(got, models.step(ref, x, models.run_plain))
    # the same through the TE context
    seen.clear()
    ctx, sync = offload.get_cpu_offload_context(True, 1, 2)
    holder["step"] = lambda: ctx.step
    _run_ctx(blocks, x.clone().requires_grad_(True), ctx, sync).sum().backward()
    assert seen == [(3, 0)]
    assert ctx.stats.bytes_offloaded == 3 * x.nbytes


def test_start_offload_base_tensor_copies_the_base_once() -> None:
    def views(x: torch.Tensor) -> torch.Tensor:
        qkv = torch.cat([x, x + 1, x + 2])  # (768, 256): q spans a third of it
        q, k, v = qkv.chunk(3)
        views.probe = StorageWeakRef(qkv.untyped_storage())
        return q

    results = {}
    for flag in (False, True):

        def make(x: torch.Tensor, flag=flag) -> torch.Tensor:
            q = views(x)
            offload.start_offload(q, offload_base_tensor=flag)
            return q

        blocks = nn.ModuleList([_SaveBlock(make), _SaveBlock(lambda x: x)])
        ref = twin(blocks)
        off = offload.ActivationOffloader(blocks, offload_layers=1, min_tensor_bytes=0)
        x = torch.randn(256, 256)
        got = models.step(blocks, x, models.run_plain, off)
        models.assert_same(got, models.step(ref, x, models.run_plain))
        assert torch.equal(blocks[0].fns[0].extra_seen, x)  # q, rebuilt from its copy
        results[flag] = off.stats.layers[0].bytes_offloaded - x.nbytes  # minus x * w
    # False: q's own span; True: the whole base (k and v would then cost no copy)
    assert results[True] - results[False] == 2 * 256 * 256 * 4


def test_start_offload_in_manual_mode_leaves_the_copy_to_the_synchronizer() -> None:
    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=2, manual_synchronization=True
    )
    seen = []

    def after(extra: torch.Tensor) -> None:
        offload.start_offload(extra)
        seen.append(len(ctx.step.d2h_queue))

    blocks = nn.ModuleList([_SaveBlock(lambda x: x.exp(), after), _SaveBlock(lambda x: x)])
    ref = twin(blocks)
    x = torch.randn(256, 256)

    def run(ls: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(ls):
            with ctx:
                h = layer(h)
            h = sync(h)
            assert sched.stats().layers[i].bytes_offloaded == 0
            sched.start_offload_layer(i)
        for i in range(2):
            sched.release_activation_forward_gpu_memory(i)
        for i in (1, 0):
            sched.start_reload_layer(i)
        return h

    models.assert_same(models.step(blocks, x, run), models.step(ref, x, models.run_plain))
    assert seen == [0, 0]  # the offloaded run, then the reference (outside any context)
    assert sched.stats().bytes_offloaded > 0
