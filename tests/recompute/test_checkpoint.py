"""Offloaded checkpointing on the CPU: ``offload.checkpoint`` against
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` and against no
checkpointing (loss and every gradient ``torch.equal``), the inputs really leave (the
original storages are freed before backward), the stats, errors, and Hugging Face's
gradient checkpointing through ``offload.integrations.hf.offload_checkpointing``.

Without an accelerator the same code runs synchronously into host pool buffers
(``offload/_recompute/_checkpoint.py``, Note [checkpoint inputs]); the GPU side is
``tests/recompute/test_checkpoint_cuda.py``.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import offload
from offload.integrations.hf import offload_checkpointing
from tests import models
from tests.models import assert_same, twin

ROOT = Path(__file__).resolve().parents[2]


class DropoutBlock(nn.Module):
    """Dropout inside the checkpointed region: the recomputation must redraw the mask."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


class NestedBlock(nn.Module):
    """Positional, nested and keyword tensor arguments; a tuple output with a list."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.gate = nn.Linear(dim, dim)

    def forward(self, x, pair, *, extras, scale=1.0):
        a, b = pair
        h = self.inner(x * extras["mask"]) + a.sigmoid() * b
        return x + scale * h * torch.sigmoid(self.gate(x)), [h.mean()]


def _ckpt_runner(ckpt: Callable[..., Any], nested: bool = False, **kw: Any):
    """A runner for ``models.step``: every layer through ``ckpt``."""

    def run(layers, x):
        if not nested:
            for layer in layers:
                x = ckpt(layer, x, **kw)
            return x
        mask = (torch.arange(x.shape[-1]) % 3 != 0).to(x.dtype).expand_as(x).contiguous()
        aux = 0
        for i, layer in enumerate(layers):
            pair = (torch.full_like(x, 0.1 * i), x.detach() * 0.5)
            x, (extra,) = ckpt(layer, x, pair, extras={"mask": mask, "s": "t"}, scale=0.5, **kw)
            aux = aux + extra
        return x + aux

    return run


def _torch_ckpt(function, *args, **kwargs):
    return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


def _no_ckpt(function, *args, **kwargs):
    for k in ("preserve_rng_state", "determinism_check", "context_fn", "debug", "early_stop"):
        kwargs.pop(k, None)
    return function(*args, **kwargs)


def _seeded_step(layers, x, runner, seed: int = 123, **kw):
    torch.manual_seed(seed)  # dropout draws the same masks in every run
    return models.step(layers, x, runner, **kw)


@pytest.fixture
def ckpt():
    off = offload.CheckpointOffloader(min_tensor_bytes=0)
    yield off
    off.close()


BLOCKS = {
    "llama": lambda: models.LlamaBlock(64),
    "dropout": DropoutBlock,
    "nested": NestedBlock,
    "kwargs": lambda: models.KwargsBlock(64),
}


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_bitwise_equal_to_torch_and_to_no_checkpointing(kind: str, ckpt) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(BLOCKS[kind]() for _ in range(4))
    ref = twin(layers)
    nested = kind == "nested"

    def runner(fn):
        if kind == "kwargs":  # a tuple output and a keyword tensor (mask) per layer
            return lambda ls, x: models.run_kwargs(
                [lambda h, layer=layer, **k: fn(layer, h, **k) for layer in ls], x
            )
        return _ckpt_runner(fn, nested=nested)

    for it in range(2):  # the second step reuses the pool
        x = torch.randn(2, 32, 64)
        got = _seeded_step(layers, x, runner(ckpt.checkpoint))
        assert_same(got, _seeded_step(ref, x, runner(_torch_ckpt)))
        assert_same(got, _seeded_step(ref, x, runner(_no_ckpt)))
        stats = ckpt.stats
        per_step = {"llama": 1, "dropout": 1, "nested": 4, "kwargs": 2}[kind]  # tensors a call
        assert stats.tensors_offloaded == (it + 1) * 4 * per_step
        assert stats.calls == (it + 1) * 4
        # every call reloads its own inputs, also those sharing an earlier call's copy
        # (the mask passed to every layer travels to the host once)
        assert stats.bytes_reloaded == stats.bytes_offloaded + stats.bytes_shared
        assert stats.bytes_offloaded > 0
        assert (stats.bytes_shared > 0) == (kind in ("nested", "kwargs"))
        assert stats.host_pool_bytes == 0  # every block back once the graph is gone
    if kind == "dropout":  # the masks were really random: a different seed differs
        other = _seeded_step(layers, x, runner(ckpt.checkpoint), seed=7)
        assert not torch.equal(other[0], got[0])


def test_inputs_are_freed_before_backward(ckpt) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(4))
    x0 = torch.randn(2, 64, 64, requires_grad=True)

    def forward(fn):
        probes, h = [], x0 * 1.0  # a non-leaf that only the first call keeps alive
        for layer in layers:
            probes.append(StorageWeakRef(h.untyped_storage()))
            h = fn(layer, h)
        return h.square().mean(), probes

    loss, probes = forward(ckpt.checkpoint)
    assert all(p.expired() for p in probes)  # only the host copies are left
    assert ckpt.stats.bytes_offloaded == 4 * x0.nbytes
    loss.backward()
    got = [p.grad.clone() for p in layers.parameters()] + [x0.grad.clone()]

    for p in [*layers.parameters(), x0]:
        p.grad = None
    loss, probes = forward(_torch_ckpt)
    assert not any(p.expired() for p in probes)  # control: torch keeps every input
    loss.backward()
    want = [p.grad for p in layers.parameters()] + [x0.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_graph_death_returns_every_block_without_gc(ckpt) -> None:
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(3))
    gc.disable()
    try:
        for backward in (True, False):
            x = torch.randn(2, 64, 64, requires_grad=True)
            loss = _ckpt_runner(ckpt.checkpoint)(layers, x).sum()
            assert ckpt.stats.host_pool_bytes == 3 * x.nbytes
            if backward:
                loss.backward()
            del loss  # without backward: the graph dies with its last reference
            assert ckpt.stats.host_pool_bytes == 0
    finally:
        gc.enable()


def test_exception_in_forward_leaks_nothing(ckpt) -> None:
    layer = models.LlamaBlock(64)
    x = torch.randn(2, 64, 64, requires_grad=True)

    def boom(h):
        layer(h)
        raise ValueError("boom")

    gc.disable()
    try:
        h = ckpt.checkpoint(layer, x)  # a live call: its block stays in use
        with pytest.raises(ValueError, match="boom"):
            ckpt.checkpoint(boom, h * 2)
        assert ckpt.stats.host_pool_bytes == x.nbytes  # only the live call's block
        del h
        assert ckpt.stats.host_pool_bytes == 0
    finally:
        gc.enable()
    # still usable afterwards
    ckpt.checkpoint(layer, x).sum().backward()
    assert ckpt.stats.host_pool_bytes == 0


def test_inplace_change_during_the_call_raises_like_torch(ckpt) -> None:
    def modifies_input(h):
        h.add_(1.0)
        return h.sin()

    for fn in (ckpt.checkpoint, _torch_ckpt):
        x = torch.randn(64, 64, requires_grad=True)
        out = fn(modifies_input, x * 2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_retain_graph_double_backward_and_autograd_grad(ckpt) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(3))
    ref = twin(layers)
    x = torch.randn(2, 32, 64)
    got = models.step(layers, x, _ckpt_runner(ckpt.checkpoint), backwards=2)
    assert_same(got, models.step(ref, x, _ckpt_runner(_torch_ckpt), backwards=2))
    stats = ckpt.stats
    assert stats.bytes_reloaded == 2 * stats.bytes_offloaded > 0

    xs = x.clone().requires_grad_(True)
    (a,) = torch.autograd.grad(_ckpt_runner(ckpt.checkpoint)(layers, xs).sum(), [xs])
    (b,) = torch.autograd.grad(_ckpt_runner(_torch_ckpt)(ref, xs).sum(), [xs])
    assert torch.equal(a, b)


def test_prefetch_counts(ckpt) -> None:
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(5))
    x = torch.randn(2, 32, 64)
    for depth in (0, 1, 2):
        off = offload.CheckpointOffloader(min_tensor_bytes=0, prefetch_layers=depth)
        models.step(layers, x, _ckpt_runner(off.checkpoint))
        s = off.stats
        # each call is reloaded once: by a later call's backward, or by its recompute;
        # the last call has no later call
        expect = 0 if depth == 0 else 4
        assert (s.reloads_prefetched, s.reloads_on_demand) == (expect, 5 - expect), depth
        off.close()


def test_kept_inputs_and_reasons() -> None:
    off = offload.CheckpointOffloader()  # default min_tensor_bytes: 256 KiB
    lin = nn.Linear(64, 64)
    small = torch.randn(8, 64, requires_grad=True)  # 2 KiB
    big = torch.randn(2048, 64, requires_grad=True)  # 512 KiB
    marked = torch.randn(2048, 64)
    marked._do_not_offload = True
    out = off.checkpoint(
        lambda a, b, c, w: F.linear(a, w).sum() + F.linear(b + c, w).sum(),
        small,
        big,
        marked,
        lin.weight,
    )
    out.backward()
    s = off.stats
    assert s.bytes_kept["small"] == small.nbytes
    assert s.bytes_kept["parameter"] == lin.weight.nbytes
    assert s.bytes_kept["opted_out"] == marked.nbytes
    assert s.bytes_offloaded == big.nbytes and s.tensors_offloaded == 1
    with offload.no_offload():  # the whole call is a plain torch checkpoint
        off.checkpoint(lin, big).sum().backward()
    assert off.stats.calls == 1
    with torch.no_grad():
        y = off.checkpoint(lin, big)
    assert torch.equal(y, lin(big).detach()) and off.stats.calls == 1
    off.close()


def test_views_shared_inputs_and_strides(ckpt) -> None:
    torch.manual_seed(0)
    w = nn.Linear(32, 32)
    base = torch.randn(4, 64, 64)
    mask = torch.rand(64, 32)  # the same tensor to every call: copied once

    def fn(a, b, m):
        return (w(a).transpose(0, 1) * w(b) * m).tanh()

    def run(ck):
        h = base.clone().requires_grad_(True)
        x = h * 1.0
        out = 0
        for _ in range(3):
            qa, qb = x.chunk(2, dim=-1)  # two views of one storage, touching spans
            out = out + ck(fn, qa.transpose(0, 1), qb, mask).sum()
            x = x.flip(0) * 1.0
        out.backward()
        return out.detach(), h.grad, w.weight.grad.clone()

    got = run(ckpt.checkpoint)
    w.weight.grad = None
    want = run(_torch_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    s = ckpt.stats
    assert s.bytes_offloaded == 3 * base.nbytes + mask.nbytes  # chunks merged; mask once
    assert s.bytes_shared == 2 * mask.nbytes


def test_selective_checkpointing_context_fn_passes_through(ckpt) -> None:
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        save = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = partial(create_selective_checkpoint_contexts, policy)
    torch.manual_seed(0)
    layers = nn.ModuleList(DropoutBlock() for _ in range(3))
    ref = twin(layers)
    x = torch.randn(2, 32, 64)
    got = _seeded_step(layers, x, _ckpt_runner(ckpt.checkpoint, context_fn=context_fn))
    want = _seeded_step(ref, x, _ckpt_runner(_torch_ckpt, context_fn=context_fn))
    assert_same(got, want)
    assert ckpt.stats.bytes_offloaded == 3 * x.nbytes


def test_host_limit_keeps_inputs_on_the_device() -> None:
    off = offload.CheckpointOffloader(min_tensor_bytes=0, host_memory_limit=0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(2))
    ref = twin(layers)
    x = torch.randn(2, 32, 64)
    with pytest.warns(RuntimeWarning, match="host_memory_limit"):
        got = models.step(layers, x, _ckpt_runner(off.checkpoint))
    assert_same(got, models.step(ref, x, _ckpt_runner(_torch_ckpt)))
    assert off.stats.bytes_offloaded == 0 and off.stats.bytes_kept["host_limit"] == 2 * x.nbytes


def test_under_an_activation_offloader(ckpt) -> None:
    """An ActivationOffloader around offloaded checkpoints: the checkpoint inputs are
    offloaded here (its hooks see only the 0-byte placeholders), gradients unchanged."""
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(3))
    ref = twin(layers)
    act = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    x = torch.randn(2, 32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing offloaded": true, and the point
        got = models.step(layers, x, _ckpt_runner(ckpt.checkpoint), act)
    assert_same(got, models.step(ref, x, _ckpt_runner(_torch_ckpt)))
    assert act.stats.bytes_offloaded == 0
    assert ckpt.stats.bytes_offloaded == 3 * x.nbytes
    act.close()


class _EventLog(offload._core._device.SyncBackend):
    """A synchronous backend that logs the waits and events an asynchronous one would
    issue (the copies themselves happen at once), to check their order on the CPU."""

    def __init__(self, device: torch.device, log: list[tuple[Any, ...]]) -> None:
        super().__init__(device)
        self.log = log
        self.count = 0

    def _event(self, kind: str) -> tuple[str, int]:
        self.count += 1
        return (kind, self.count)

    def current_stream(self) -> str:
        return "compute"

    def d2h(self, pairs, fence, times=None, transient=None, ready=None) -> None:
        super().d2h(pairs, fence, times, transient, ready)
        self.log.append(("d2h", fence))

    def record_d2h(self):
        event = self._event("d2h")
        self.log.append(("record", event))
        return event

    def h2d(self, pairs, waits, stream, times=None):
        super().h2d(pairs, waits, stream)
        event = self._event("h2d")
        self.log.append(("h2d", tuple(waits), stream, event))
        return event

    def wait(self, stream, event, times=None) -> None:
        self.log.append(("wait", stream, event))

    def wait_current(self, event, times=None) -> None:
        self.log.append(("wait", "compute", event))


def test_waits_and_events_in_order(monkeypatch) -> None:
    """Note [checkpoint inputs] with an event-logging backend: the compute stream waits
    for a call's D2H before the call returns (4.1(b)); a reload waits for the D2H that
    filled its host bytes and the recomputation for the reload (4.1(c)); the next D2H
    into the pool waits for the newest reload (4.1(d)); a prefetched buffer that is
    never used is waited for before it is dropped (4.1(e))."""
    log: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        offload._core._runtime, "backend_for", lambda d, _stream=None: _EventLog(d, log)
    )
    off = offload.CheckpointOffloader(min_tensor_bytes=0, prefetch_layers=2)
    layers = nn.ModuleList(models.LlamaBlock(64) for _ in range(3))
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: log.append(("run", i)))
    x = torch.randn(2, 32, 64, requires_grad=True)
    h = x
    for i, layer in enumerate(layers):
        h = off.checkpoint(layer, h)
        log.append(("returned", i))
    h.sum().backward()

    d2h_events = [e[1] for e in log if e[0] == "record"]
    assert len(d2h_events) == 3
    for i, event in enumerate(d2h_events):
        returned = log.index(("returned", i))
        assert log.index(("wait", "compute", event)) < returned  # before the call returns
    reloads = [e for e in log if e[0] == "h2d"]
    assert sorted(r[1] for r in reloads) == [(e,) for e in d2h_events]
    for r in reloads:
        (d2h,) = r[1]
        call = d2h_events.index(d2h)
        wait = log.index(("wait", "compute", r[3]))
        recompute = [j for j, e in enumerate(log) if e == ("run", call)][1]  # 2nd run
        assert log.index(r) < wait < recompute
    assert [r[1][0] for r in reloads] == d2h_events[::-1]  # 2 on demand, then 1, 0 ahead

    # the next forward's first D2H waits for the newest reload (the pool's H2D fence)
    log.clear()
    out = off.checkpoint(layers[0], x)
    assert log[0] == ("d2h", reloads[-1][3])
    first = log[1][1]  # the D2H event of this call
    # prefetched by the backward of `out2`'s call, never recomputed: waited, then dropped
    out2 = off.checkpoint(layers[1], out)
    (g,) = torch.autograd.grad(out2.sum(), [out])  # the backward of layers[1] only
    (prefetch,) = [e for e in log if e[0] == "h2d" and e[1] == (first,)]
    assert ("wait", "compute", prefetch[3]) not in log
    del out, out2, g
    assert ("wait", "compute", prefetch[3]) in log
    assert off.stats.host_pool_bytes == 0
    off.close()


def test_errors() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        offload.checkpoint(lin, x, use_reentrant=True)
    with pytest.raises(TypeError, match="use_reentrant"):
        offload.checkpoint(lin, x, use_reentrant="no")
    with pytest.raises(ValueError, match="determinism_check"):
        offload.checkpoint(lin, x, determinism_check="bogus")
    assert offload.checkpoint(lin, x, use_reentrant=None).shape == (2, 4)
    with pytest.raises(TypeError, match="min_tensor_bytes"):
        offload.CheckpointOffloader(min_tensor_bytes=1.5)
    with pytest.raises(ValueError, match="prefetch_layers=-1"):
        offload.CheckpointOffloader(prefetch_layers=-1)
    with pytest.raises(TypeError, match="host_memory_limit"):
        offload.CheckpointOffloader(host_memory_limit="1GB")
    with pytest.raises(TypeError, match="pin_memory"):
        offload.CheckpointOffloader(pin_memory=1)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        offload_checkpointing(lin)


def test_a_function_that_is_not_callable_raises_naming_function() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    for call in (offload.checkpoint, offload.CheckpointOffloader().checkpoint):
        with pytest.raises(TypeError, match=r"function must be callable.*got int 42"):
            call(42, x)


def test_default_offloader_and_checkpoint_stats() -> None:
    offload.checkpoint_stats(reset=True)
    lin = nn.Linear(256, 256)
    x = torch.randn(512, 256, requires_grad=True)  # 512 KiB: above the default threshold
    offload.checkpoint(lin, x, preserve_rng_state=False).sum().backward()
    stats = offload.checkpoint_stats(reset=True)
    assert stats.bytes_offloaded == stats.bytes_reloaded == x.nbytes
    assert stats.reloads_on_demand == 1
    assert offload.checkpoint_stats().bytes_offloaded == 0
    assert json.loads(json.dumps(stats.to_dict()))["bytes_offloaded"] == x.nbytes
    assert "checkpoint" in offload.__all__ and "CheckpointOffloader" in offload.__all__


# ---- Hugging Face ----------------------------------------------------------------------

BATCH, SEQ, HIDDEN, LAYERS, VOCAB = 2, 16, 32, 3, 64


def _hf_model(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        name,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.0,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.train()


def _plain_checkpointing(model: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_hf_offload_checkpointing(name: str) -> None:
    model = _hf_model(name)
    ref = copy.deepcopy(model)
    _plain_checkpointing(ref)
    off = offload.CheckpointOffloader(min_tensor_bytes=0)
    handle = offload_checkpointing(model, offloader=off)
    layers = list(model.model.layers)
    assert handle.modules >= LAYERS and all(
        layer._gradient_checkpointing_func.func == off.checkpoint for layer in layers
    )
    gen = torch.Generator().manual_seed(1)
    probes: list[StorageWeakRef] = []

    def probe(module: nn.Module, args: tuple[Any, ...]) -> None:
        probes.append(StorageWeakRef(args[0].untyped_storage()))

    for step in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        probes.clear()
        hooks = [layer.register_forward_pre_hook(probe) for layer in layers]
        loss = model(ids, labels=ids).loss
        for h in hooks:
            h.remove()
        # every layer's hidden-states input is gone from the device before backward:
        # layer 0's too (the embedding output, dropped when the model's forward returns)
        assert len(probes) == LAYERS and all(p.expired() for p in probes)
        loss.backward()
        want = ref(ids, labels=ids).loss
        want.backward()
        assert torch.equal(loss, want)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert p.grad is not None and torch.equal(p.grad, q.grad), n
        stats = off.stats
        # L, not L - 1: every checkpointed call (the last one too) copies the hidden
        # states it gets positionally; the keyword arguments (position embeddings, mask)
        # are bound into HF's functools.partial and stay on the device. fp32 here.
        hidden = BATCH * SEQ * HIDDEN * 4
        assert stats.bytes_offloaded == (step + 1) * LAYERS * hidden
        assert stats.bytes_reloaded == stats.bytes_offloaded
        assert stats.reloads_prefetched == (step + 1) * (LAYERS - 1)
        assert stats.host_pool_bytes == 0
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
    handle.remove()
    handle.remove()  # idempotent
    assert all(layer._gradient_checkpointing_func.func is torch_checkpoint for layer in layers)
    model(ids, labels=ids).loss.backward()  # plain checkpointing again
    assert off.stats.calls == 2 * LAYERS
    off.close()


def test_hf_default_offloader_and_reentrant_refused() -> None:
    model = _hf_model("llama")
    with pytest.raises(ValueError, match="use_reentrant"):
        offload_checkpointing(model, {"use_reentrant": True})
    offload.checkpoint_stats(reset=True)
    with offload_checkpointing(model, {"preserve_rng_state": False}) as handle:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        model(ids, labels=ids).loss.backward()
        assert handle.offloader is offload._recompute._checkpoint._default_offloader()
    assert handle.removed
    # tiny hidden states (4 KiB) stay under the default min_tensor_bytes
    stats = offload.checkpoint_stats(reset=True)
    assert (
        stats.bytes_offloaded == 0
        and stats.bytes_kept["small"] == LAYERS * BATCH * SEQ * HIDDEN * 4
    )


# ---- the benchmark's CPU smoke mode -------------------------------------------------------


@pytest.mark.slow  # a benchmark or launcher run end to end: `-m slow`
def test_bench_checkpoint_quick_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/checkpoint/bench_checkpoint.py",
            "--quick",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert {r["mode"] for r in rows} == {"checkpoint", "offload.checkpoint"}
    for r in rows:
        if r["mode"] == "offload.checkpoint":
            assert r["bytes_offloaded"] == r["checkpoint_input_bytes"] > 0
    assert "step ms" in proc.stdout
