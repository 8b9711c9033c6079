"""CUDA graphs, the scheduling half, on the CPU: ``offload._core._device.capturing`` is
patched to say "capturing", so the synchronous backend runs exactly what a capture
records (Note [release order], "CUDA graphs"). The captures themselves are tested on the
GPU in ``test_graphs_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload._core import _device
from offload.activations import _graphs
from offload.activations._auto._probe import Meter
from offload.activations._control import Internals
from tests import models
from tests.models import twin


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``state[0]``: what ``_device.capturing()`` answers (starts True)."""
    state = [True]
    monkeypatch.setattr(_device, "capturing", lambda: state[0])
    return state


def _model(n: int = 4) -> tuple[nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)
    layers = nn.ModuleList(models.LlamaBlock(64, 4, 128) for _ in range(n))
    x = torch.randn(2, 16, 64, requires_grad=True)
    return layers, x


def _step(layers: nn.ModuleList, x: torch.Tensor, ctx=None) -> list[torch.Tensor]:
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    h = x
    if ctx is None:
        for layer in layers:
            h = layer(h)
    else:
        with ctx:
            for layer in layers:
                h = layer(h)
    h.square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


def test_whole_step_capture_binds_host_blocks(capturing: list[bool]) -> None:
    layers, x = _model()
    ref_layers = twin(layers)
    capturing[0] = False
    want = _step(ref_layers, x)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    capturing[0] = True
    got = _step(layers, x, off)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    stats = off.stats
    assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
    assert off.last_step.capture == "step"
    rt = Internals(off).runtime
    # every block the captured step wrote stays bound to the graph after its backward
    bound = sum(b.nbytes for b in rt.graph_blocks)
    assert bound >= stats.bytes_offloaded
    assert rt.pool.in_use_bytes == bound
    # an eager step afterwards takes other blocks and returns them
    capturing[0] = False
    _step(layers, x, off)
    assert off.last_step.capture is None
    assert rt.pool.in_use_bytes == bound
    addresses = {(id(b.slab), b.start) for b in rt.graph_blocks}
    assert len(addresses) == len(rt.graph_blocks)
    off.close()  # a graph may still be replayed: its blocks and their slabs stay
    assert sum(b.nbytes for b in rt.graph_blocks) == bound
    assert all(b.slab is not None and b.slab.buffer.numel() for b in rt.graph_blocks)
    assert off.free_graph_memory() == bound
    assert rt.graph_blocks == [] and rt.pool.in_use_bytes == 0
    assert off.free_graph_memory() == 0


def test_captured_step_never_waits_for_or_sets_the_fence(capturing: list[bool]) -> None:
    layers, x = _model(3)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    capturing[0] = False
    _step(layers, x, off)
    rt = Internals(off).runtime
    seen: list[object] = []
    backend = rt.backend(torch.device("cpu"))
    original = backend.d2h

    def d2h(pairs, fence, times=None, transient=None, ready=None):
        seen.append(fence)
        return original(pairs, fence, times, transient, ready)

    backend.d2h = d2h  # type: ignore[method-assign]
    sentinel = object()
    rt.pool.h2d_fence = sentinel
    capturing[0] = True
    _step(layers, x, off)
    assert seen and all(f is None for f in seen)
    assert rt.pool.h2d_fence is sentinel  # a captured reload does not become the fence
    capturing[0] = False
    seen.clear()
    _step(layers, x, off)
    assert seen and all(f is sentinel for f in seen)
    off.close()


def test_capture_begun_after_entry_is_refused(capturing: list[bool]) -> None:
    layers, x = _model(2)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    capturing[0] = False
    with pytest.raises(RuntimeError, match="Enter the offloader inside the capture"):
        with off:
            capturing[0] = True
            layers[0](x)
    capturing[0] = False
    _step(layers, x, off)  # usable afterwards
    assert off.stats.bytes_offloaded > 0
    off.close()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"timing": True}, RuntimeError, "timing=True"),
        ({"compress": "fp8"}, NotImplementedError, "compress='fp8'"),
    ],
)
def test_settings_a_capture_cannot_honour(
    capturing: list[bool], kwargs: dict, error: type, match: str
) -> None:
    layers, x = _model(2)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0, **kwargs)
    with pytest.raises(error, match=match):
        with off:
            layers[0](x)
    assert off.last_step.graph_host_bytes == 0  # no host block bound to a graph
    off.close()


def test_auto_probe_in_capture_is_refused(capturing: list[bool]) -> None:
    layers, x = _model(2)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)  # "auto"
    Internals(off).use_meter(Meter())  # the host clock
    with pytest.raises(RuntimeError, match="run two eager steps"):
        with off:
            layers[0](x)
    off.close()


def test_auto_decided_before_a_capture_runs_its_choice_unmeasured(capturing: list[bool]) -> None:
    """Two eager steps measure and decide; inside a capture the step runs the choice
    and reads nothing from the device (no event query, no wait, no memory reading)."""
    from offload.activations._auto._predict import LayerCost
    from tests.auto_fake import FakeMeter

    layers, x = _model(4)
    meter = FakeMeter(lambda n: [LayerCost(10e-3, 20e-3, 0)] * 4, 1e10)
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)  # "auto"
    Internals(off).use_meter(meter)
    capturing[0] = False
    for _ in range(2):
        _step(layers, x, off)
    chosen = off.stats.auto["chosen"]
    assert chosen == [0, 1, 2]
    seen = len(meter.records)
    read = []
    meter.memory = lambda device: read.append(device)  # type: ignore[method-assign]
    meter.seconds = lambda a, b: read.append((a, b))  # type: ignore[method-assign]
    capturing[0] = True
    with off:
        h = x
        for layer in layers:
            h = layer(h)
    capturing[0] = False
    assert off.stats.auto["offloaded"] == chosen and read == [] and len(meter.records) == seen
    off.close()


# ---- per-layer captures ------------------------------------------------------------------


def _graphed_by_hand(
    layers: nn.ModuleList, x: torch.Tensor, off: offload.ActivationOffloader
) -> list[torch.Tensor]:
    """What torch.cuda.make_graphed_callables does with each layer, minus the graphs: a
    warm-up call (not capturing), then each layer's forward captured alone, then the
    backwards captured in reverse order."""
    capture = _graphs._LayerCapture(off)
    for p in layers.parameters():
        p.grad = None
    with capture:
        inputs, outputs = [], []
        h = x
        for layer in layers:
            inp = h.detach().requires_grad_(True)
            inputs.append(inp)
            outputs.append(layer(inp))
            h = outputs[-1]
        grads = [None] * len(layers)
        g = torch.autograd.grad(outputs[-1].square().mean(), outputs[-1])[0]
        for i in reversed(range(len(layers))):
            params = list(layers[i].parameters())
            res = torch.autograd.grad(outputs[i], [inputs[i], *params], g)
            g = res[0]
            grads[i] = res[1:]
    off._show_stats_of(_graphs._Captured(capture.steps))  # as make_graphed_callables
    return [t for gi in grads for t in gi] + [g]


def test_layer_capture_each_layer_is_self_contained(capturing: list[bool]) -> None:
    layers, x = _model(4)
    ref_layers = twin(layers)
    capturing[0] = False
    want = _step(ref_layers, x)
    off = offload.ActivationOffloader(layers, offload_layers=[0, 2, 3], min_tensor_bytes=0)
    capturing[0] = True
    released: list[int] = []
    original = offload.activations._step.Step._release

    def spy(self, group):
        released.append(len(group.device_refs))
        return original(self, group)

    offload.activations._step.Step._release = spy  # type: ignore[method-assign]
    try:
        got = _graphed_by_hand(layers, x, off)
    finally:
        offload.activations._step.Step._release = original  # type: ignore[method-assign]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    stats = off.stats
    assert [s.index for s in stats.layers] == [0, 1, 2, 3]
    assert [s.bytes_offloaded > 0 for s in stats.layers] == [True, False, True, True]
    assert stats.bytes_reloaded == stats.bytes_offloaded > 0
    # each offloaded layer released its device references when it closed
    assert all(la.released for la in off.last_step.layers if la.planned)
    assert sum(1 for n in released if n) == 3
    assert off.last_step.graph_host_bytes == off.stats.host_pool_bytes > 0
    off.close()


def test_layer_capture_warm_up_calls_keep_everything(capturing: list[bool]) -> None:
    layers, x = _model(2)
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    capturing[0] = False
    with _graphs._LayerCapture(off) as capture:
        layers[1](layers[0](x)).sum().backward()
    assert capture.steps == []
    assert Internals(off).runtime.pool_if_made is None  # nothing was copied


def test_make_graphed_callables_argument_errors() -> None:
    layers, _ = _model(2)
    with pytest.raises(TypeError, match="offloader must be an offload.ActivationOffloader"):
        offload.make_graphed_callables(tuple(layers), (), offloader=object())
    auto = offload.ActivationOffloader(layers)
    with pytest.raises(ValueError, match="offload_layers='auto'"):
        offload.make_graphed_callables(tuple(layers), (), offloader=auto)
    if not torch.cuda.is_available():
        off = offload.ActivationOffloader(layers, offload_layers=1)
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            offload.make_graphed_callables(tuple(layers), (), offloader=off)


def test_te_style_context_captured_binds_its_host_blocks(capturing: list[bool]) -> None:
    layers, _ = _model(4)
    x = torch.randn(4, 512, 64, requires_grad=True)  # tensors above TE's size threshold
    ref_layers = twin(layers)
    capturing[0] = False
    want = _step(ref_layers, x)
    ctx, sync = offload.get_cpu_offload_context(
        True, num_layers=2, model_layers=4, retain_pinned_cpu_buffers=True
    )
    capturing[0] = True
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    h.square().mean().backward()
    got = [p.grad for p in layers.parameters()] + [x.grad]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert ctx.step.capture == "step"
    stats = ctx.stats
    assert stats.bytes_offloaded > 0
    rt = ctx.runtime
    assert sum(b.nbytes for b in rt.graph_blocks) == rt.pool.in_use_bytes > 0
