"""WeightOffloader on the CPU: the synchronous path runs every decision of the CUDA path
(residency, prefetch, holds, gradients to the host, state dicts, errors), so each test
compares bitwise with the same model trained without offloading."""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload._core._device import Backend
from offload.weights import WeightOffloader
from tests import models

DIM, HEADS, FFN = 32, 4, 64


def llama(n: int = 4, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(models.LlamaBlock(DIM, HEADS, FFN) for _ in range(n))


class LoraLinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update (LoRA)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class LoraBlock(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = models.RMSNorm(dim).requires_grad_(False)
        self.up = LoraLinear(dim, 2 * dim)
        self.down = LoraLinear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class FusedBlock(nn.Module):
    """Weights written by fused wgrad GEMMs (no .grad), a bias and a norm (with .grad)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = offload.nn.Linear(dim, 2 * dim, fuse_wgrad_accumulation=True)
        self.fc2 = offload.nn.Linear(2 * dim, dim, bias=False, fuse_wgrad_accumulation=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def loss_of(layers, x, runner=models.run_plain) -> torch.Tensor:
    return runner(layers, x).float().square().mean()


def inputs(steps: int, seed: int = 1, shape=(2, 8, DIM)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(steps)]


def assert_equal_params(got, want) -> None:
    got, want = list(got), list(want)
    assert len(got) == len(want) and got
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"parameter {i} differs: max {(a - b).abs().max()}"


def assert_equal_states(opt_a, params_a, opt_b, params_b) -> None:
    """Optimizer states bitwise equal, parameter by parameter (AdamW: step, moments)."""
    for pa, pb in zip(params_a, params_b):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


def storage_sizes(layers) -> list[int]:
    return [p.untyped_storage().nbytes() for p in layers.parameters()]


def assert_all_freed(layers) -> None:
    assert all(n == 0 for n in storage_sizes(layers)), storage_sizes(layers)


def assert_all_back(layers) -> None:
    for p in layers.parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()


# ---- training, bitwise against no offloading -------------------------------------------


def train_reference(layers, xs, lr=1e-2, runner=models.run_plain):
    opt = torch.optim.AdamW(layers.parameters(), lr=lr)
    for x in xs:
        loss_of(layers, x.clone().requires_grad_(True), runner).backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_trainable_grads_on_device_bitwise(activations: bool, prefetch: int) -> None:
    layers, ref = llama(), llama()
    xs = inputs(3)
    ref_opt = train_reference(ref, xs)
    off = WeightOffloader(layers, prefetch_layers=prefetch)
    acts = offload.ActivationOffloader(layers, min_tensor_bytes=0) if activations else None
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-2)
    assert_all_freed(layers)
    for x in xs:
        with acts if acts is not None else contextlib.nullcontext():
            loss = loss_of(layers, x.clone().requires_grad_(True))
        # after the forward only the last `prefetch` layers stay, for their backward
        assert off.resident_layers == list(range(4 - prefetch, 4))
        loss.backward()
        assert off.resident_layers == []
        assert all(p.grad is not None for p in layers.parameters())
        with off.resident():
            assert off.resident_layers == [0, 1, 2, 3]
            opt.step()
        assert off.resident_layers == []
        opt.zero_grad()
        if acts is not None:
            # weights are never offloaded as activations, whatever their storage does
            stats = acts.stats
            assert stats.bytes_kept["parameter"] > 0
            assert stats.bytes_offloaded > 0
    assert_equal_states(opt, list(layers.parameters()), ref_opt, list(ref.parameters()))
    off.close()
    assert_all_back(layers)
    assert_equal_params(layers.parameters(), ref.parameters())
    if acts is not None:
        acts.close()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("frozen", [False, True])
def test_at_most_prefetch_plus_one_layers_resident(prefetch: int, frozen: bool) -> None:
    """Forward and backward: layer i and the prefetch_layers after (before) it, no more;
    after the first step every refill is a prefetch, except the first layer's."""
    if frozen:  # LoRA-style: the input does not require grad, frozen base weights
        torch.manual_seed(0)
        layers = nn.ModuleList(LoraBlock() for _ in range(6))
    else:
        layers = llama(6)
    off = WeightOffloader(layers, prefetch_layers=prefetch)
    for step, x in enumerate(inputs(3)):
        if not frozen:
            x.requires_grad_(True)
        before = off.refills_on_demand
        loss_of(layers, x).backward()
        if step:
            assert off.refills_on_demand - before == (12 if prefetch == 0 else 1)
    assert off.max_resident_layers == prefetch + 1
    assert off.resident_layers == []
    off.close()


def test_activation_stats_unchanged_by_weight_offloading() -> None:
    """The activation offloader classifies the same bytes with and without it."""
    results = []
    for with_weights in (False, True):
        layers = llama()
        off = WeightOffloader(layers) if with_weights else None
        acts = offload.ActivationOffloader(layers, min_tensor_bytes=0)
        for x in inputs(2):
            with acts:
                loss = loss_of(layers, x.clone().requires_grad_(True))
            loss.backward()
        s = acts.stats
        results.append((s.bytes_offloaded, dict(s.bytes_kept), dict(s.bytes_by_dtype)))
        acts.close()
        if off is not None:
            off.close()
    assert results[0] == results[1]


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_trainable_grads_on_host_bitwise(activations: bool, set_to_none: bool) -> None:
    layers, ref = llama(), llama()
    xs = inputs(3)
    ref_opt = train_reference(ref, xs)
    off = WeightOffloader(layers, grads="host")
    masters = off.host_parameters()
    assert len(masters) == len(list(layers.parameters()))
    assert all(m.dtype == torch.float32 and m.grad is not None for m in masters)
    acts = offload.ActivationOffloader(layers, min_tensor_bytes=0) if activations else None
    opt = torch.optim.AdamW(masters, lr=1e-2)
    for x in xs:
        with acts if acts is not None else contextlib.nullcontext():
            loss = loss_of(layers, x.clone().requires_grad_(True))
        loss.backward()
        assert all(p.grad is None for p in layers.parameters())  # moved to main_grad
        assert off.resident_layers == []
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        off.push()
    assert_equal_states(opt, masters, ref_opt, list(ref.parameters()))
    assert_equal_params(masters, ref.parameters())
    # the host weights the refills read are the pushed masters
    sd = layers.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(sd[key], value), key
    off.close()
    assert_equal_params(layers.parameters(), ref.parameters())
    if acts is not None:
        acts.close()


def test_host_grads_accumulate_and_overwrite() -> None:
    """Two micro-batches: main_grad is the sum; with overwrite_main_grad, the last one."""
    layers, ref = llama(2), llama(2)
    xs = inputs(2)
    for x in xs:
        loss_of(ref, x.clone().requires_grad_(True)).backward()
    off = WeightOffloader(layers, grads="host")
    for x in xs:
        loss_of(layers, x.clone().requires_grad_(True)).backward()
    for m, p in zip(off.host_parameters(), ref.parameters()):
        assert torch.equal(m.grad, p.grad)
    for p in layers.parameters():
        p.overwrite_main_grad = True
    last = [p.grad.clone() for p in ref.parameters()]
    for p in ref.parameters():
        p.grad = None
    loss_of(ref, xs[1].clone().requires_grad_(True)).backward()
    loss_of(layers, xs[1].clone().requires_grad_(True)).backward()
    for m, p in zip(off.host_parameters(), ref.parameters()):
        assert torch.equal(m.grad, p.grad)
        assert not torch.equal(m.grad, last[0]) or m.numel() == 0
    off.close()


@pytest.mark.parametrize("grads", ["device", "host"])
def test_lora_frozen_base_bitwise(grads: str) -> None:
    def build():
        torch.manual_seed(0)
        return nn.ModuleList(LoraBlock() for _ in range(3))

    layers, ref = build(), build()
    xs = inputs(3)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=1e-2)
    for x in xs:  # the input does not require grad (frozen embeddings)
        loss_of(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    off = WeightOffloader(layers, grads=grads)
    params = [p for p in layers.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(off.host_parameters() if grads == "host" else params, lr=1e-2)
    for x in xs:
        loss_of(layers, x).backward()
        assert off.resident_layers == []
        if grads == "host":
            opt.step()
            off.push()
        else:
            with off.resident(params):
                opt.step()
        opt.zero_grad()
    stepped = off.host_parameters() if grads == "host" else params
    assert_equal_states(opt, stepped, ref_opt, trainable)
    off.close()
    assert_equal_params(layers.parameters(), ref.parameters())


def test_inference_frozen_at_most_prefetch_plus_one_resident() -> None:
    layers = llama(6)
    ref = copy.deepcopy(layers)
    for m in (layers, ref):
        m.requires_grad_(False)
    seen: list[list[int]] = []
    off = WeightOffloader(layers, prefetch_layers=1)
    for layer in layers:
        layer.register_forward_pre_hook(lambda *a: seen.append(off.resident_layers))
    x = torch.randn(2, 8, DIM)
    with torch.no_grad():
        got, want = models.run_plain(layers, x), models.run_plain(ref, x)
    assert torch.equal(got, want)
    assert seen == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5]]
    assert off.resident_layers == []  # nothing kept without a backward to come
    # grad enabled but nothing requires grad: nothing kept either
    models.run_plain(layers, x)
    assert off.resident_layers == []
    assert off.refills == 12
    off.close()


@pytest.mark.parametrize("grads", ["device", "host"])
def test_fused_wgrad_layers_bitwise(grads: str) -> None:
    def build():
        torch.manual_seed(0)
        return nn.ModuleList(FusedBlock() for _ in range(3))

    layers, ref = build(), build()
    xs = inputs(3)
    offload.main_grad.attach(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x in xs:
        loss_of(ref, x.clone().requires_grad_(True)).backward()
        offload.main_grad.to_grads(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        offload.main_grad.zero_(ref)
    if grads == "device":
        offload.main_grad.attach(layers)
        off = WeightOffloader(layers)
        opt = torch.optim.AdamW(layers.parameters(), lr=1e-2)
        for x in xs:
            loss_of(layers, x.clone().requires_grad_(True)).backward()
            assert layers[0].fc1.weight.grad is None  # dW went into main_grad
            offload.main_grad.to_grads(layers)
            with off.resident():
                opt.step()
            opt.zero_grad()
            offload.main_grad.zero_(layers)
        stepped = list(layers.parameters())
    else:
        off = WeightOffloader(layers, grads="host")
        opt = torch.optim.AdamW(off.host_parameters(), lr=1e-2)
        for x in xs:
            loss_of(layers, x.clone().requires_grad_(True)).backward()
            # the staging main_grad exists only while its layer runs
            assert not any(hasattr(p, "main_grad") for p in layers.parameters())
            opt.step()
            opt.zero_grad()
            off.push()
        stepped = off.host_parameters()
    assert_equal_states(opt, stepped, ref_opt, list(ref.parameters()))
    off.close()
    assert_equal_params(layers.parameters(), ref.parameters())


def test_fused_weight_with_main_grad_and_host_grads_is_refused() -> None:
    layers = nn.ModuleList(FusedBlock() for _ in range(2))
    offload.main_grad.attach(layers)
    with pytest.raises(ValueError, match="main_grad"):
        WeightOffloader(layers, grads="host")
    assert_all_back(layers)


# ---- other graphs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "runner",
    [
        models.run_kwargs,
        models.run_inplace_outside,
        lambda layers, x: models.run_checkpointed(layers, x, reentrant=True),
        lambda layers, x: models.run_checkpointed(layers, x, reentrant=False),
    ],
    ids=["kwargs", "inplace", "checkpoint_reentrant", "checkpoint"],
)
def test_other_graphs_same_gradients(runner) -> None:
    kwargs = runner is models.run_kwargs
    torch.manual_seed(0)
    if kwargs or runner is models.run_inplace_outside:
        cls = models.KwargsBlock if kwargs else models.InplaceBlock
        layers = nn.ModuleList(cls(DIM) for _ in range(3))
    else:
        layers = llama(3)
    ref = copy.deepcopy(layers)
    x = torch.randn(2, 8, DIM)
    want = models.step(ref, x, runner)
    off = WeightOffloader(layers)
    for _ in range(2):
        models.assert_same(models.step(layers, x, runner), want)
        assert off.resident_layers == []
    off.close()


def test_module_called_twice_and_listed_twice() -> None:
    torch.manual_seed(0)
    block = models.LlamaBlock(DIM, HEADS, FFN)
    other = models.LlamaBlock(DIM, HEADS, FFN)
    layers = [block, other, block]  # ALBERT-style reuse
    ref_block, ref_other = copy.deepcopy(block), copy.deepcopy(other)
    x = torch.randn(2, 8, DIM)
    want = models.step([ref_block, ref_other, ref_block], x, models.run_plain)
    off = WeightOffloader(layers)
    assert len(off.parameters()) == len(list(block.parameters())) * 2
    got = models.step(layers, x, models.run_plain)
    models.assert_same((got[0], got[1][: len(want[1])], got[2]), want)
    assert off.resident_layers == []
    off.close()


def test_micro_batches_graphs_alive_and_retain_graph() -> None:
    layers, ref = llama(3), llama(3)
    xs = inputs(2)
    for x in xs:
        loss_of(ref, x.clone().requires_grad_(True)).backward()
    off = WeightOffloader(layers)
    losses = [loss_of(layers, x.clone().requires_grad_(True)) for x in xs]
    for loss in reversed(losses):  # two graphs alive, backward in reverse order
        loss.backward()
    for a, b in zip(layers.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    # retain_graph: the second backward brings the weights back again
    for p in layers.parameters():
        p.grad = None
    x = xs[0].clone().requires_grad_(True)
    loss = loss_of(layers, x)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in layers.parameters()]
    loss.backward()
    for g, p in zip(first, layers.parameters()):
        assert torch.equal(p.grad, 2 * g)
    assert off.resident_layers == []
    off.close()


def test_get_cpu_offload_context_offload_weights() -> None:
    layers, ref = llama(3), llama(3)
    xs = inputs(3)
    ref_opt = train_reference(ref, xs)
    ctx, sync = offload.get_cpu_offload_context(True, 2, 3, offload_weights=True)
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-2)
    for x in xs:
        h = x.clone().requires_grad_(True)
        for layer in layers:
            with ctx:
                h = layer(h)
            h = sync(h)
        h.float().square().mean().backward()
        # the first num_layers=2 layers were found and offloaded; the third was not
        assert ctx.weights.resident_layers == []
        assert all(n == 0 for n in storage_sizes(layers[:2]))
        assert all(n > 0 for n in storage_sizes(layers[2:]))
        with ctx.weights.resident():
            opt.step()
        opt.zero_grad()
        assert len(ctx.stats.layers) == 3  # the activation context's stats
    ctx.weights.close()
    assert_equal_params(layers.parameters(), ref.parameters())
    assert_equal_states(opt, list(layers.parameters()), ref_opt, list(ref.parameters()))
    # weights only
    ctx2, sync2 = offload.get_cpu_offload_context(
        True, 1, 2, offload_activations=False, offload_weights=True
    )
    with ctx2:
        y = layers[0](xs[0])
    sync2(y).sum().backward()
    assert ctx2.weights.resident_layers == [] and storage_sizes(layers[:1])[0] == 0
    ctx2.weights.close()


# ---- state dicts, close ----------------------------------------------------------------


@pytest.mark.parametrize("late", [False, True])
def test_state_dict_round_trip_while_offloaded(late: bool, request) -> None:
    if late:
        request.getfixturevalue("late_copies")
    layers = llama(3)
    model = nn.Sequential(nn.Linear(DIM, DIM), *layers)  # one resident module too
    want = {k: v.clone() for k, v in model.state_dict().items()}
    off = WeightOffloader(layers)
    assert_all_freed(layers)
    sd = model.state_dict()
    assert sd.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
    for k, v in model.state_dict(keep_vars=True).items():
        assert torch.equal(v, want[k]), k
    torch.manual_seed(5)
    new = {k: torch.randn_like(v) for k, v in want.items()}
    model.load_state_dict(new)
    assert_all_freed(layers)  # loaded into the host copies, then freed again
    for k, v in model.state_dict().items():
        assert torch.equal(v, new[k]), k
    # the device picks them up: same forward as a model loaded without offloading
    off2_ref = nn.Sequential(nn.Linear(DIM, DIM), *llama(3))
    off2_ref.load_state_dict(new)
    x = torch.randn(2, 8, DIM)
    with torch.no_grad():
        assert torch.equal(model(x), off2_ref(x))
    with pytest.raises(RuntimeError, match="assign"):
        model.load_state_dict(new, assign=True)
    off.close()
    for k, v in model.state_dict().items():
        assert torch.equal(v, new[k]), k


def test_close_restores_idempotent_context_and_gc() -> None:
    layers = llama(3)
    want = [p.detach().clone() for p in layers.parameters()]
    ids = [id(p) for p in layers.parameters()]
    with WeightOffloader(layers) as off:
        assert_all_freed(layers)
        loss_of(layers, torch.randn(2, 8, DIM)).backward()
    assert_all_back(layers)
    assert_equal_params(layers.parameters(), want)
    assert [id(p) for p in layers.parameters()] == ids
    off.close()  # again: nothing happens
    off.close()
    # hooks are gone: a forward leaves the storages alone
    loss_of(layers, torch.randn(2, 8, DIM)).backward()
    assert_all_back(layers)
    with pytest.raises(RuntimeError, match="closed"):
        with off.resident():
            pass
    # garbage collection closes it too
    off = WeightOffloader(layers)
    assert_all_freed(layers)
    del off
    gc.collect()
    assert_all_back(layers)
    assert_equal_params(layers.parameters(), want)


def test_bytes_and_layers_accounting() -> None:
    layers = llama(3)
    nbytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    off = WeightOffloader(layers)
    assert off.bytes_offloaded == nbytes
    assert off.host_bytes >= nbytes
    assert off.pinned_bytes == 0  # no accelerator: plain host memory
    assert off.parameters() == list(layers.parameters())
    # an optimizer step over offloaded weights outside resident() is refused
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    loss_of(layers, torch.randn(2, 8, DIM)).backward()
    with pytest.raises(RuntimeError, match=r"resident\(\)"):
        opt.step()
    with off.resident():
        opt.step()
    assert "3 layers" in repr(off)
    with pytest.raises(RuntimeError, match="grads='host'"):
        off.host_parameters()
    with pytest.raises(RuntimeError, match="grads='host'"):
        off.push()
    off.close()
    assert "closed" in repr(off)


# ---- exceptions ------------------------------------------------------------------------


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


class FailingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = models.LlamaBlock(DIM, HEADS, FFN)
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x):
        x = self.inner(x)
        if self.fail_forward:
            raise ValueError("boom in forward")
        return _Boom.apply(x) if self.fail_backward else x


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("grads", ["device", "host"])
def test_exception_leaves_everything_restorable(
    where: str, grads: str, late: bool, request
) -> None:
    if late:
        request.getfixturevalue("late_copies")
    torch.manual_seed(0)
    layers = nn.ModuleList(FailingBlock() for _ in range(4))
    ref = copy.deepcopy(layers)
    want = [p.detach().clone() for p in layers.parameters()]
    off = WeightOffloader(layers, grads=grads)
    acts = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    setattr(layers[2], f"fail_{where}", True)
    x = torch.randn(2, 8, DIM)
    with pytest.raises(ValueError, match=f"boom in {where}"):
        with acts:
            loss = loss_of(layers, x.clone().requires_grad_(True))
        loss.backward()
    loss = None
    gc.collect()
    if where == "forward":
        assert off.resident_layers == []  # prefetches of the failed forward dropped
    assert acts.stats.host_pool_bytes == 0
    # the next step cleans up after the failed one and is correct
    setattr(layers[2], f"fail_{where}", False)
    for p in layers.parameters():
        p.grad = None
    with acts:
        loss = loss_of(layers, x.clone().requires_grad_(True))
    loss.backward()
    assert off.resident_layers == []
    assert acts.stats.host_pool_bytes == 0
    if grads == "host":
        assert off._grad_pool is None or off._grad_pool.in_use_bytes == 0
        off.host_parameters()[0].grad = None  # drop what the failed step accumulated
    loss_of(ref, x.clone().requires_grad_(True)).backward()
    if grads == "device":
        for a, b in zip(layers.parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad)
    off.close()
    acts.close()
    assert_all_back(layers)
    assert_equal_params(layers.parameters(), want)


# ---- bad input -------------------------------------------------------------------------


def test_argument_errors() -> None:
    layers = llama(2)
    with pytest.raises(TypeError, match="prefetch_layers"):
        WeightOffloader(layers, prefetch_layers=1.0)
    with pytest.raises(TypeError, match="prefetch_layers"):
        WeightOffloader(layers, prefetch_layers=True)
    with pytest.raises(ValueError, match="prefetch_layers=-1"):
        WeightOffloader(layers, prefetch_layers=-1)
    with pytest.raises(ValueError, match=r"grads='cpu'.*\['device', 'host'\]"):
        WeightOffloader(layers, grads="cpu")
    with pytest.raises(TypeError, match="grads"):
        WeightOffloader(layers, grads=None)
    with pytest.raises(TypeError, match="pin_memory"):
        WeightOffloader(layers, pin_memory=1)
    with pytest.raises(TypeError, match="single LlamaBlock"):
        WeightOffloader(layers[0])
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        WeightOffloader([layers[0], "x"])
    with pytest.raises(ValueError, match="empty"):
        WeightOffloader([])
    with pytest.raises(ValueError, match="no parameters"):
        WeightOffloader([nn.ReLU(), nn.Identity()])
    assert_all_back(layers)  # nothing happened


def test_layer_without_parameters_is_skipped() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList([models.LlamaBlock(DIM, HEADS, FFN), nn.GELU()])
    ref = copy.deepcopy(layers)
    off = WeightOffloader(layers)
    assert len(off.parameters()) == len(list(layers[0].parameters()))
    x = torch.randn(2, 8, DIM)
    models.assert_same(
        models.step(layers, x, models.run_plain), models.step(ref, x, models.run_plain)
    )
    off.close()


def test_shared_and_tied_parameters() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight  # shared between two offloaded layers
    with pytest.raises(ValueError, match="shares its storage"):
        WeightOffloader([a, b])
    assert a.weight.untyped_storage().nbytes() > 0
    # a parameter tied to a module outside `layers` (embedding and head)
    embed, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.Linear(8, 8), head)
    off = WeightOffloader([head])
    with pytest.raises(ValueError, match=r"'0.weight'.*layers\[0\]"):
        off.check(model)
    with pytest.raises(TypeError):
        off.check("model")
    off.close()
    model(torch.tensor([[1, 2]]))  # fine again
    WeightOffloader([model[1]]).check(model)  # nothing shared: no error


def test_storage_shared_with_other_tensors_is_refused() -> None:
    flat = torch.randn(200)
    layer = nn.Linear(8, 8)
    layer.weight = nn.Parameter(flat[:64].view(8, 8))  # a view of a larger buffer
    with pytest.raises(ValueError, match="cover"):
        WeightOffloader([layer])


def test_parameters_on_meta_or_mixed_devices() -> None:
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta"):
        WeightOffloader([meta])


def test_fsdp2_is_refused_with_a_pointer_to_cpu_offload_policy() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.fsdp import fully_shard

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for layer in layers:
                fully_shard(layer)
        with pytest.raises(ValueError, match="CPUOffloadPolicy"):
            WeightOffloader(layers)
    finally:
        if started:
            dist.destroy_process_group()


# ---- the CUDA path's waits, with copies that land as late as allowed --------------------


class _LateEvent:
    """Copies that run only when someone waits for them (or for a later event of the
    same stream): the latest moment a real copy stream could finish them."""

    def __init__(self, copies: list, prev: _LateEvent | None) -> None:
        self.copies = copies
        self.prev = prev
        self.lock = threading.RLock()

    def run(self) -> None:
        with self.lock:  # locks are taken newer -> older only: no deadlock
            prev, self.prev = self.prev, None  # stream order: earlier copies first
            if prev is not None:
                prev.run()
            copies, self.copies = self.copies, []
            for src, dst, _codec in copies:  # weights never travel compressed
                dst.copy_(src)


class LateBackend(Backend):
    """``CudaBackend``'s contract on the CPU: a device-to-host copy reads its source only
    when waited for, a host-to-device copy fills its destination with garbage at once
    and writes it only when waited for. A missing wait reads garbage (a mismatch) or an
    emptied storage (an error)."""

    is_async = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = object()
        self.pending: list = []
        self.last_d2h: _LateEvent | None = None
        self.last_h2d: _LateEvent | None = None

    def current_stream(self):
        return self.stream

    def d2h(self, pairs, fence, times=None, transient=None, ready=None):
        if fence is not None:
            fence.run()
        self.pending.extend(pairs)

    def record_d2h(self):
        self.last_d2h = _LateEvent(self.pending, self.last_d2h)
        self.pending = []
        return self.last_d2h

    def h2d(self, pairs, waits, stream, times=None):
        for event in waits:
            if event is not None:
                event.run()
        for _src, dst, _codec in pairs:
            dst.fill_(255)  # not written yet: NaN in every float dtype
        self.last_h2d = _LateEvent(list(pairs), self.last_h2d)
        return self.last_h2d

    def wait(self, stream, event, times=None):
        if event is not None:
            event.run()

    def record(self, stream):
        return _LateEvent([], None)

    def host_wait(self, event):
        if event is not None:
            event.run()


@pytest.fixture
def late_copies(monkeypatch):
    import offload.weights._lifecycle as impl

    monkeypatch.setattr(impl, "backend_for", LateBackend)


@pytest.mark.parametrize("grads", ["device", "host"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_late_copies_still_bitwise(late_copies, grads: str, prefetch: int) -> None:
    layers, ref = llama(), llama()
    xs = inputs(3)
    ref_opt = train_reference(ref, xs)
    off = WeightOffloader(layers, prefetch_layers=prefetch, grads=grads)
    assert isinstance(off._backend, LateBackend)
    acts = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    stepped = off.host_parameters() if grads == "host" else list(layers.parameters())
    opt = torch.optim.AdamW(stepped, lr=1e-2)
    for x in xs:
        with acts:
            loss = loss_of(layers, x.clone().requires_grad_(True))
        loss.backward()
        assert off.resident_layers == []
        if grads == "host":
            opt.step()
            off.push()
        else:
            with off.resident():
                opt.step()
        opt.zero_grad()
    sd = layers.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(sd[key], value), key
    assert_equal_states(opt, stepped, ref_opt, list(ref.parameters()))
    off.close()
    acts.close()
    assert_equal_params(layers.parameters(), ref.parameters())


def test_late_copies_fused_lora_and_checkpointing(late_copies) -> None:
    def build():
        torch.manual_seed(0)
        return nn.ModuleList([FusedBlock(), LoraBlock(), FusedBlock()])

    def runner(ls, h):
        return models.run_checkpointed(ls, h, reentrant=False)

    layers, ref = build(), build()
    offload.main_grad.attach(ref)
    x = torch.randn(2, 8, DIM)
    want = loss_of(ref, x.clone().requires_grad_(True), runner)
    want.backward()
    off = WeightOffloader(layers, grads="host")
    for _ in range(2):
        for m in off.host_parameters():
            m.grad = None
        got = loss_of(layers, x.clone().requires_grad_(True), runner)
        got.backward()
        assert torch.equal(got.detach(), want.detach())
        assert off.resident_layers == []
    trainable = [p for p in ref.parameters() if p.requires_grad]
    for m, p in zip(off.host_parameters(), trainable):
        assert torch.equal(m.grad, p.main_grad if p.grad is None else p.grad)
    off.close()
